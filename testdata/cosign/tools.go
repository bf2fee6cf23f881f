//go:build tools

// Package tools pins the cosign CLI that internal/testing/tools builds for the
// signature interoperability tests (internal/testing/e2e): vmsnap verifies what
// `cosign sign --key` wrote, and `cosign verify --key` what vmsnap wrote.
package tools

import _ "github.com/sigstore/cosign/v2/cmd/cosign"
