package agent

// Arbitrary API requests: every answer is 2xx, or 4xx with a JSON error
// document carrying a code whose status it is. Never a 5xx, never a panic.

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// fuzzServer is an agent with a resolver that knows no VM: requests are
// parsed and validated for real, and no operation ever starts (so that the
// fuzzer cannot make the agent write to paths or dial hosts it names).
func fuzzServer(tb testing.TB) *Server {
	tb.Helper()
	s, err := New(context.Background(), Config{
		StateDir: tb.TempDir(), Resolver: newStaticResolver(), LayoutRoot: tb.TempDir(),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// asAdmin serves h as an admin caller's connection would be (the fuzz
// tests call the handler directly, without a socket and its peer).
func asAdmin(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r.WithContext(withCaller(r.Context(), Caller{Admin: true})))
	})
}

// checkAPIResponse fails unless rec is a 2xx, or a 4xx whose body is one
// strict {"error": {...}} document with a code that maps to its status.
func checkAPIResponse(tb testing.TB, what string, rec *httptest.ResponseRecorder) api.Error {
	tb.Helper()
	if rec.Code >= 500 || rec.Code < 200 {
		tb.Fatalf("%s: status %d, body %q", what, rec.Code, rec.Body.String())
	}
	if rec.Code < 300 {
		return api.Error{}
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		tb.Fatalf("%s: status %d with Content-Type %q", what, rec.Code, ct)
	}
	var doc api.ErrorDoc
	dec := json.NewDecoder(bytes.NewReader(rec.Body.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		tb.Fatalf("%s: status %d with a body that is not an error document: %v: %q", what, rec.Code, err, rec.Body.String())
	}
	if doc.Error.Code == "" || doc.Error.Message == "" || HTTPStatus(doc.Error.Code) != rec.Code {
		tb.Fatalf("%s: status %d with error %+v", what, rec.Code, doc.Error)
	}
	return doc.Error
}

func FuzzCheckpointRequest(f *testing.F) {
	uid := "3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f"
	s := fuzzServer(f)
	x := "oci:" + s.cfg.LayoutRoot + "/x" // a layout the policy allows
	for _, b := range []string{
		`{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/run/vm/qmp.sock"},"image":"` + x + `:vm","mode":"pause"}`,
		`{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/run/vm/qmp.sock","disk":"/run/vm/overlay.qcow2"},"image":"` + x + `:vm","diskImage":"` + x + `:disk"}`,
		`{"vm":{"podUID":"../../etc","container":"qemu","qmp":"/q"},"image":"` + x + `:t"}`,
		`{"vm":{"podUID":"` + uid + `\u0000","container":"qemu","qmp":"/q"},"image":"` + x + `:t"}`,
		`{"vm":{"podUID":"","container":"qemu","qmp":"/q"},"image":"` + x + `:t"}`,
		`{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/q"},"image":"` + x + `:t","mode":"teleport"}`,
		`{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/q"},"image":"` + x + `:t","chunkSize":-1,"workers":-5}`,
		`{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/q"},"image":"` + x + `:t","unknown":1}`,
		`{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/q"},"image":"` + x + `:t"} {"again":1}`,
		`{"vm":{"podUID":` + strings.Repeat("[", 10000) + `}}`,
		`null`, `[]`, ``, `{"vm":{"podUID":1}}`, "\xff\xfe",
	} {
		f.Add(uint8(0), "", []byte(b))
		f.Add(uint8(1), "", []byte(b))
	}
	f.Add(uint8(2), "0123456789abcdef", []byte(nil))
	f.Add(uint8(3), "../../etc/passwd", []byte(nil))
	f.Add(uint8(4), "%zz", []byte(nil))
	h := asAdmin(s.Handler())
	f.Fuzz(func(t *testing.T, kind uint8, id string, body []byte) {
		var req *http.Request
		switch kind % 5 {
		case 0:
			req = httptest.NewRequest(http.MethodPost, "/v1/checkpoints", bytes.NewReader(body))
		case 1:
			req = httptest.NewRequest(http.MethodPost, "/v1/restores", bytes.NewReader(body))
		case 2:
			req = httptest.NewRequest(http.MethodGet, "/v1/operations/"+url.PathEscape(id), nil)
		case 3:
			req = httptest.NewRequest(http.MethodDelete, "/v1/operations/"+url.PathEscape(id), nil)
		case 4:
			// The event stream runs until the client leaves: leave soon.
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
			defer cancel()
			req = httptest.NewRequest(http.MethodGet, "/v1/events?operation="+url.QueryEscape(id), nil).WithContext(ctx)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if k := kind % 5; (k == 2 || k == 3) && (id == "" || id == "." || id == "..") {
			// No route matches: http.ServeMux answers 404 or a redirect in
			// text/plain, without an error document (see the report).
			if rec.Code >= 500 {
				t.Fatalf("%s %s: status %d", req.Method, req.URL.Path, rec.Code)
			}
			return
		}
		checkAPIResponse(t, req.Method+" "+req.URL.Path, rec)
		if rec.Code < 300 && kind%5 < 2 {
			t.Fatalf("the resolver knows no VM, yet %s was accepted: %s", body, rec.Body)
		}
	})
}

// TestAPIRefusesHostileRequests: one case per attack, each with its code.
func TestAPIRefusesHostileRequests(t *testing.T) {
	uid := "3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f"
	s := fuzzServer(t)
	x := "oci:" + s.cfg.LayoutRoot + "/x" // a layout the policy allows
	good := `{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/q"},"image":"` + x + `:t"}`
	pad := func(n int) string {
		return `{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/q"},"image":"` + x + `:t","mode":"` + strings.Repeat("p", n) + `"}`
	}
	h := asAdmin(s.Handler())
	for _, tc := range []struct {
		name, method, path, body string
		code                     errcode.Code
		says                     string
	}{
		{"oversized body", "POST", "/v1/checkpoints", pad(maxRequestBody), errcode.InvalidInput, "over 65536 bytes"},
		{"oversized restore", "POST", "/v1/restores", pad(10 << 20), errcode.InvalidInput, "over 65536 bytes"},
		{"unknown field", "POST", "/v1/checkpoints", strings.TrimSuffix(good, "}") + `,"cpuModel":"host"}`, errcode.InvalidInput, "unknown field"},
		{"unknown nested field", "POST", "/v1/checkpoints", strings.Replace(good, `"qmp":"/q"`, `"qmp":"/q","podName":"web-0"`, 1), errcode.InvalidInput, "unknown field"},
		{"trailing data", "POST", "/v1/checkpoints", good + `{}`, errcode.InvalidInput, "data after"},
		{"not JSON", "POST", "/v1/checkpoints", `vm=1`, errcode.InvalidInput, "malformed"},
		{"empty body", "POST", "/v1/restores", ``, errcode.InvalidInput, "malformed"},
		{"wrong type", "POST", "/v1/checkpoints", `{"vm":{"podUID":42}}`, errcode.InvalidInput, "malformed"},
		{"deep nesting", "POST", "/v1/checkpoints", strings.Repeat("[", 20000), errcode.InvalidInput, "malformed"},
		{"no pod UID", "POST", "/v1/checkpoints", strings.Replace(good, uid, "", 1), errcode.VMNotFound, "pod UID"},
		// The static resolver knows no pod; the containerd resolver refuses
		// these as INVALID_INPUT before asking containerd (tested there).
		{"pod UID with a path", "POST", "/v1/checkpoints", strings.Replace(good, uid, "../../../etc", 1), errcode.VMNotFound, ""},
		{"pod UID with a NUL", "POST", "/v1/restores", strings.Replace(good, uid, uid+`\u0000`, 1), errcode.VMNotFound, ""},
		{"no container", "POST", "/v1/checkpoints", strings.Replace(good, `"qemu"`, `""`, 1), errcode.Usage, "container"},
		{"unknown mode", "POST", "/v1/checkpoints", strings.TrimSuffix(good, "}") + `,"mode":"teleport"}`, errcode.Usage, "teleport"},
		{"live with disk", "POST", "/v1/checkpoints", strings.Replace(strings.TrimSuffix(good, "}")+`,"mode":"live","diskImage":"`+x+`:d"}`, `"qmp":"/q"`, `"qmp":"/q","disk":"/d"`, 1), errcode.Usage, "live"},
		{"restore with disk", "POST", "/v1/restores", strings.Replace(good, `"qmp":"/q"`, `"qmp":"/q","disk":"/d"`, 1), errcode.Usage, "disk"},
		{"restore without image", "POST", "/v1/restores", strings.Replace(good, `"`+x+`:t"`, `""`, 1), errcode.Usage, "image"},
		// An id never issued is a bad request; an operation dropped with its
		// VM is VM_NOT_FOUND (agent_test covers that).
		{"unknown operation", "GET", "/v1/operations/deadbeef", ``, errcode.InvalidInput, "no operation"},
		{"cancel unknown operation", "DELETE", "/v1/operations/..%2F..%2Fetc", ``, errcode.InvalidInput, "no operation"},
		{"events of unknown operation", "GET", "/v1/events?operation=nope", ``, errcode.InvalidInput, "no operation"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := httptest.NewRequest(tc.method, tc.path, strings.NewReader(tc.body))
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			e := checkAPIResponse(t, tc.name, rec)
			if e.Code != tc.code || !strings.Contains(e.Message, tc.says) {
				t.Fatalf("status %d, error %+v; want %s saying %q", rec.Code, e, tc.code, tc.says)
			}
		})
	}
}
