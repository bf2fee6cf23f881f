package mounter

import (
	"os"
	"path"
	"strings"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// openSource opens a publication directory: source must be below one of
// the publication roots, with no link and no mount point on the way, and
// be named volumeID (so that a publication serves one volume). It is
// opened O_PATH: the bind mount is made from this descriptor.
func (s *Server) openSource(source, volumeID string) (*os.File, error) {
	if path.Clean(source) != source || path.Base(source) != volumeID {
		return nil, errcode.New(errcode.Forbidden, "publication %q is not a clean path named after its volume id %q", source, volumeID)
	}
	for _, root := range s.cfg.PublicationRoots {
		rel, ok := strings.CutPrefix(source, root+"/")
		if !ok {
			continue
		}
		dir, err := beneath.Dir(root)
		if err != nil {
			return nil, errcode.Wrap(errcode.Internal, err, "opening the publication root")
		}
		defer dir.Close()
		f, err := beneath.Open(dir, rel, source)
		if err != nil {
			return nil, errcode.Wrap(errcode.Forbidden, err, "opening the publication beneath its root")
		}
		if t, err := beneath.Type(f); err != nil || !t.IsDir() {
			f.Close()
			return nil, errcode.New(errcode.Forbidden, "publication %s is not a directory", source)
		}
		return f, nil
	}
	return nil, errcode.New(errcode.Forbidden, "publication %q is below none of the mounter's publication roots %q", source, s.cfg.PublicationRoots)
}
