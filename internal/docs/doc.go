// Package docs checks the project's documentation, README.md and the pages
// in docs/: every relative link names a file that exists and, with a
// fragment, a heading in it. It holds no code of the product; the CLI
// reference (docs/cli.md) is checked by cmd/vmsnap, which renders it.
package docs
