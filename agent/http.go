package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// maxRequestBody bounds a request's body: requests are a few hundred bytes.
const maxRequestBody = 64 << 10

// maxHeaderBytes bounds a request's head (net/http allows 4 KiB more): a
// client of this API sends a few hundred bytes; the default, 1 MiB per
// connection, would let a caller make the agent hold a megabyte per
// connection it may open.
const maxHeaderBytes = 16 << 10

// bodyTimeout bounds reading a request's body, as the server's
// ReadHeaderTimeout bounds its headers: a caller that trickles a body, or
// announces one and sends nothing, must not hold a connection and a
// goroutine of the agent for good. (The server has no ReadTimeout: it
// would end event streams.)
var bodyTimeout = 10 * time.Second

// Handler is the agent's HTTP API:
//
//	POST   /v1/checkpoints          api.CheckpointRequest -> 202 api.Operation
//	POST   /v1/restores             api.RestoreRequest    -> 202 api.Operation
//	POST   /v1/prepares             api.PrepareRequest    -> 202 api.Operation
//	GET    /v1/operations           {"operations": [api.Operation]}
//	GET    /v1/operations/{id}      api.Operation
//	DELETE /v1/operations/{id}      cancel -> 202 api.Operation
//	GET    /v1/events[?operation=ID] text/event-stream of api.Event
//	GET    /healthz, /readyz, /metrics
//
// Errors are {"error": api.Error} with a status derived from the code.
// Every /v1 request is made by a Caller (caller.go), who sees and touches
// only its own namespace's VMs and operations unless it is an admin.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	v1 := func(pattern string, h http.HandlerFunc) { mux.HandleFunc(pattern, s.identified(h)) }
	v1("POST /v1/checkpoints", starting(s, api.KindCheckpoint, s.StartCheckpoint, func(q api.CheckpointRequest) []any {
		return []any{"pod", q.VM.PodUID, "container", q.VM.Container, "image", q.Image, "mode", q.Mode}
	}))
	v1("POST /v1/restores", starting(s, api.KindRestore, s.StartRestore, func(q api.RestoreRequest) []any {
		return []any{"pod", q.VM.PodUID, "container", q.VM.Container, "image", q.Image}
	}))
	v1("POST /v1/prepares", starting(s, api.KindPrepare, s.StartPrepare, func(q api.PrepareRequest) []any {
		return []any{"image", q.Image, "namespace", q.Namespace}
	}))
	v1("GET /v1/operations", func(w http.ResponseWriter, r *http.Request) {
		c, _ := callerFrom(r.Context())
		writeJSON(w, http.StatusOK, map[string][]api.Operation{"operations": s.ops.list(c.sees)})
	})
	v1("GET /v1/operations/{id}", func(w http.ResponseWriter, r *http.Request) {
		o, err := s.visibleOp(r.Context(), r.PathValue("id"))
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, o.snapshot())
	})
	v1("DELETE /v1/operations/{id}", func(w http.ResponseWriter, r *http.Request) {
		o, err := s.visibleOp(r.Context(), r.PathValue("id"))
		if err != nil {
			writeError(w, err)
			return
		}
		if o.cancel != nil {
			c, _ := callerFrom(r.Context())
			s.log.Info("operation cancelled by a caller", "op", o.id, "caller", c.String())
			o.cancel(errcode.New(errcode.Internal, "cancelled by a caller"))
		}
		writeJSON(w, http.StatusAccepted, o.snapshot())
	})
	v1("GET /v1/events", s.serveEvents)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-s.ready:
		default:
			http.Error(w, "not watching containers yet", http.StatusServiceUnavailable)
			return
		}
		probe := filepath.Join(s.journal.dir, ".ready")
		if err := os.WriteFile(probe, nil, 0o600); err != nil {
			http.Error(w, "state directory not writable: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		_ = os.Remove(probe)
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{}))
	// Everything else gets a JSON error with a code, like every answer.
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, errcode.New(errcode.InvalidInput, "no endpoint %s %s: the API is listed by `vmsnap agent --help`", r.Method, r.URL.Path))
	})
	return recovering(s.log, mux)
}

// starting is the handler of a request R that starts an operation of
// kind: it decodes the request, logs it with what describe says of it and
// its caller, and answers 202 with the operation start began.
func starting[R any](s *Server, kind string, start func(context.Context, R) (api.Operation, error), describe func(R) []any) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req R
		if !decode(w, r, &req) {
			return
		}
		c, _ := callerFrom(r.Context())
		s.log.Info(kind+" requested", append(describe(req), "caller", c.String())...)
		respond(w, http.StatusAccepted)(start(r.Context(), req))
	}
}

// decode reads a JSON request strictly: unknown fields, trailing data and
// oversized bodies are refused with INVALID_INPUT.
func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(bodyTimeout))
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxRequestBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, errcode.New(errcode.InvalidInput, "request body over %d bytes", maxRequestBody))
		} else {
			writeError(w, errcode.Wrap(errcode.InvalidInput, err, "reading the request"))
		}
		return false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		writeError(w, errcode.Wrap(errcode.InvalidInput, err, "malformed request"))
		return false
	}
	if dec.More() {
		writeError(w, errcode.New(errcode.InvalidInput, "malformed request: data after the JSON object"))
		return false
	}
	return true
}

func respond(w http.ResponseWriter, status int) func(api.Operation, error) {
	return func(o api.Operation, err error) {
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, status, o)
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, err error) {
	status, doc := ErrorResponse(err)
	writeJSON(w, status, doc)
}

// ErrorResponse is the answer to an API request that failed with err: its
// HTTP status and error document. It never panics, whatever err is (see
// api.ErrorOf).
func ErrorResponse(err error) (int, api.ErrorDoc) {
	e := api.ErrorOf(err)
	return HTTPStatus(e.Code), api.ErrorDoc{Error: e}
}

// HTTPStatus is the status of a failed API request with this code.
func HTTPStatus(c errcode.Code) int {
	switch c {
	case errcode.Usage, errcode.InvalidInput, errcode.TagNotAllowed:
		return http.StatusBadRequest
	case errcode.VMNotFound:
		return http.StatusNotFound
	case errcode.Forbidden:
		return http.StatusForbidden
	case errcode.Busy, errcode.CompatMismatch:
		return http.StatusConflict
	case errcode.AuthFailed, errcode.RegistryError, errcode.QMPError, errcode.DigestMismatch:
		return http.StatusBadGateway
	}
	return http.StatusInternalServerError
}
