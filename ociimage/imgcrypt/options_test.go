package imgcrypt

import (
	"slices"
	"testing"

	"github.com/vmsnap/vmsnap/ociimage"
)

// The options merge as they did when ociimage had them: keys add up, the
// last encryption wins, decryption sits under encryption; and an option
// given to one Open is unchanged for the next.
func TestOptionsMergeAndAreReusable(t *testing.T) {
	f := newEncFixture(t, 2)
	ref := ociimage.Reference{Layout: t.TempDir()}
	forA := WithEncryption(EncryptOptions{Recipients: f.rcpt[:1]})
	forAB := WithEncryption(EncryptOptions{Recipients: f.rcpt})
	keyA, keyB := WithDecryptionKeys(f.priv[0]), WithDecryptionKeys(f.priv[1])
	for _, c := range []struct {
		name string
		opts []ociimage.Option
		want []string // EncryptsFor
		keys int      // of the Decrypt under it
	}{
		{"A with a key", []ociimage.Option{forA, keyA}, []string{f.rcpt[0].ID}, 1},
		{"AB with the same key option", []ociimage.Option{forAB, keyA}, sortedIDs(f.rcpt), 1},
		{"keys add up", []ociimage.Option{keyA, forA, keyB}, []string{f.rcpt[0].ID}, 2},
		{"the last encryption wins", []ociimage.Option{forAB, keyB, forA}, []string{f.rcpt[0].ID}, 1},
		{"keys alone", []ociimage.Option{keyB}, nil, 1},
	} {
		repo, err := ociimage.Open(t.Context(), ref, c.opts...)
		if err != nil {
			t.Fatal(err)
		}
		if got := EncryptsFor(repo); !slices.Equal(got, c.want) {
			t.Errorf("%s: encrypts for %v, want %v", c.name, got, c.want)
		}
		under := repo
		if e, ok := repo.(*encrypting); ok {
			under = e.Repository
		}
		d, ok := under.(*decrypting)
		if !ok || len(d.keys) != c.keys {
			t.Errorf("%s: %T under the encryption (if any), want a Decrypt with %d keys", c.name, under, c.keys)
		}
	}
}

func sortedIDs(rs []Recipient) []string {
	var ids []string
	for _, r := range rs {
		ids = append(ids, r.ID)
	}
	slices.Sort(ids)
	return ids
}
