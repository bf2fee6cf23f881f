package csi

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// grpcError gives the kubelet a status it acts on: codes it retries
// (Unavailable, DeadlineExceeded, Aborted) for what may pass, final ones for
// what the pod must change. The message keeps vmsnap's code in front, so the
// pod's events say which one.
func grpcError(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok && !errcode.Has(err) {
		return err
	}
	c := errcode.Of(err)
	msg := string(c) + ": " + err.Error()
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, msg)
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, msg)
	}
	return status.Error(grpcCode(c), msg)
}

func grpcCode(c errcode.Code) codes.Code {
	switch c {
	case errcode.Usage, errcode.InvalidInput, errcode.TagNotAllowed:
		return codes.InvalidArgument
	case errcode.Forbidden, errcode.AuthFailed:
		return codes.PermissionDenied
	case errcode.DigestMismatch, errcode.CompatMismatch:
		return codes.FailedPrecondition
	case errcode.Busy, errcode.RegistryError:
		return codes.Unavailable
	}
	return codes.Internal
}
