package agent

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/vmsnap/vmsnap/agent/api"
)

// metrics are the agent's Prometheus series, on a registry of its own.
type metrics struct {
	reg        *prometheus.Registry
	total      *prometheus.CounterVec   // kind, outcome
	duration   *prometheus.HistogramVec // kind
	bytes      *prometheus.CounterVec   // kind, what (raw, stored, uploaded)
	throughput *prometheus.HistogramVec // kind
	downtime   prometheus.Histogram
	inFlight   *prometheus.GaugeVec   // kind, state (pending, running)
	refusals   *prometheus.CounterVec // resource (limits.go)
	cache      *cacheMetrics
}

func newMetrics() *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		total: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vmsnap_operations_total", Help: "Operations ended, by kind and outcome (succeeded, failed, cancelled).",
		}, []string{"kind", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vmsnap_operation_duration_seconds", Help: "Wall time of operations that ended, by kind.",
			Buckets: prometheus.ExponentialBuckets(0.1, 2, 14),
		}, []string{"kind"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vmsnap_operation_bytes_total", Help: "Bytes of VM state and disk moved: raw (uncompressed), stored (compressed) and uploaded (new to the store).",
		}, []string{"kind", "what"}),
		throughput: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vmsnap_operation_throughput_bytes_per_second", Help: "Raw bytes per second of operations that succeeded.",
			Buckets: prometheus.ExponentialBuckets(1<<20, 2, 14),
		}, []string{"kind"}),
		downtime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vmsnap_guest_downtime_seconds", Help: "Guest downtime of checkpoints that succeeded.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vmsnap_operations_in_flight", Help: "Operations pending or running now.",
		}, []string{"kind", "state"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vmsnap_caller_limit_refusals_total", Help: "Requests and connections refused because their caller held its limit, by resource (connections, streams, operations).",
		}, []string{"resource"}),
		cache: newCacheMetrics(),
	}
	m.reg.MustRegister(m.cache.collectors()...)
	m.reg.MustRegister(m.total, m.duration, m.bytes, m.throughput, m.downtime, m.inFlight, m.refusals,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) finished(kind, outcome string, seconds float64) {
	m.total.WithLabelValues(kind, outcome).Inc()
	if seconds > 0 {
		m.duration.WithLabelValues(kind).Observe(seconds)
	}
}

func (m *metrics) moved(o api.Operation, seconds float64) {
	var raw, stored, uploaded int64
	if c := o.Checkpoint; c != nil {
		raw, stored, uploaded = c.VMState.RawBytes, c.VMState.StoredBytes, c.VMState.UploadedBytes
		if d := c.Disk; d != nil {
			raw, stored, uploaded = raw+d.RawBytes, stored+d.StoredBytes, uploaded+d.UploadedBytes
		}
		m.downtime.Observe(c.DowntimeMs / 1000)
	}
	if r := o.Restore; r != nil && r.VMState != nil {
		raw = r.VMState.RawBytes
	}
	m.bytes.WithLabelValues(o.Kind, "raw").Add(float64(raw))
	m.bytes.WithLabelValues(o.Kind, "stored").Add(float64(stored))
	m.bytes.WithLabelValues(o.Kind, "uploaded").Add(float64(uploaded))
	if seconds > 0 && raw > 0 {
		m.throughput.WithLabelValues(o.Kind).Observe(float64(raw) / seconds)
	}
}
