package mounter

import (
	"os"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// handle does what req asks. f is the descriptor the request carried, if
// any: handle owns it. It returns the descriptor to send back, if any.
func (s *Server) handle(req request, f *os.File) (*os.File, error) {
	if f != nil && req.Op != opPutFUSE {
		f.Close()
		return nil, errcode.New(errcode.InvalidInput, "a mounter %q request carries a descriptor it has no use for", req.Op)
	}
	if req.Version != Version {
		if f != nil {
			f.Close()
		}
		return nil, versionError(req.Version)
	}
	switch req.Op {
	case opPublish:
		if req.Publish == nil {
			return nil, errcode.New(errcode.InvalidInput, "a mounter publish request without its publish object")
		}
		err := s.publish(*req.Publish)
		if err == nil {
			p := req.Publish
			s.log.Info("published", "volumeID", p.VolumeID, "podUID", p.PodUID, "target", p.Target, "source", p.Source, "readOnly", p.ReadOnly)
		}
		return nil, err
	case opUnpublish:
		if req.Unpublish == nil {
			return nil, errcode.New(errcode.InvalidInput, "a mounter unpublish request without its unpublish object")
		}
		err := s.unpublish(*req.Unpublish)
		if err == nil {
			s.log.Info("unpublished", "volumeID", req.Unpublish.VolumeID, "target", req.Unpublish.Target)
		}
		return nil, err
	case opPutFUSE:
		if f == nil {
			return nil, errcode.New(errcode.InvalidInput, "a mounter put-fuse-fd request without a descriptor")
		}
		if err := s.fuse.put(f); err != nil {
			f.Close()
			return nil, err
		}
		return nil, nil
	case opGetFUSE:
		return s.fuse.get()
	}
	return nil, errcode.New(errcode.InvalidInput, "unknown mounter operation %q", req.Op)
}
