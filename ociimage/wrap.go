package ociimage

// Repositories that wrap another: signing and verification here,
// encryption and decryption in package imgcrypt. Open puts them together;
// these say what is underneath.

// Unwrapper is a Repository that wraps another (signing, verification,
// imgcrypt's Encrypt and Decrypt).
type Unwrapper interface {
	Unwrap() Repository
}

// Underlying returns the store under any wrappers: the manifests and blobs
// as stored.
func Underlying(repo Repository) Repository {
	for {
		u, ok := repo.(Unwrapper)
		if !ok {
			return repo
		}
		repo = u.Unwrap()
	}
}

// Wrapper is what Open puts around the repository it opened, above
// signing and verification, which see the manifests as stored: how
// imgcrypt encrypts and decrypts layers (imgcrypt.WithEncryption,
// imgcrypt.WithDecryptionKeys).
type Wrapper interface {
	// Wrap returns repo inside the wrapper.
	Wrap(repo Repository) (Repository, error)
	// Merge returns what w and later, a Wrapper given after w, do
	// together.
	Merge(later Wrapper) Wrapper
}

// WithWrapper has Open wrap the repository with w, merged into the one
// given before (Wrapper.Merge) if there was one.
func WithWrapper(w Wrapper) Option {
	// The option may be given to many Opens: it changes o, never w.
	return func(o *openOptions) {
		if o.wrap != nil {
			o.wrap = o.wrap.Merge(w)
			return
		}
		o.wrap = w
	}
}

// TransformsReads reports whether repo, or one it wraps, reads manifests
// and blobs other than those stored (imgcrypt's Decrypt reads the
// plaintext layers): a copy through it has manifest digests of its own,
// and a range of a stored blob is not a range of what it reads. A wrapper
// says so with a method TransformsReads() bool.
func TransformsReads(repo Repository) bool {
	for {
		if r, ok := repo.(interface{ TransformsReads() bool }); ok && r.TransformsReads() {
			return true
		}
		u, ok := repo.(Unwrapper)
		if !ok {
			return false
		}
		repo = u.Unwrap()
	}
}
