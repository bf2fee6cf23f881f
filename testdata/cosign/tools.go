//go:build tools

// Package tools pins the cosign CLI that internal/testtools builds for the
// signature interoperability tests (internal/e2e): vmsnap verifies what
// `cosign sign --key` wrote, and `cosign verify --key` what vmsnap wrote.
package tools

import _ "github.com/sigstore/cosign/v2/cmd/cosign"
