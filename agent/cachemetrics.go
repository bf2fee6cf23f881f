package agent

import (
	"os"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// cacheMetrics are the RAM file caches' series, per namespace: what
// prepares and CSI publications found there (hits), fetched (misses,
// bytes) and evicted, and what each cache holds now.
type cacheMetrics struct {
	hits, misses, fetched, evictions *prometheus.CounterVec // namespace
}

func newCacheMetrics() *cacheMetrics {
	counter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"namespace"})
	}
	return &cacheMetrics{
		hits:      counter("vmsnap_ram_cache_hits_total", "Prepares and CSI publications whose RAM file the namespace's cache held (nothing fetched)."),
		misses:    counter("vmsnap_ram_cache_misses_total", "Prepares and CSI publications that fetched their RAM file into the namespace's cache."),
		fetched:   counter("vmsnap_ram_cache_fetched_bytes_total", "Bytes fetched into the namespace's RAM cache."),
		evictions: counter("vmsnap_ram_cache_evictions_total", "RAM files removed from the namespace's cache by its size and age bounds."),
	}
}

func (m *cacheMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.hits, m.misses, m.fetched, m.evictions}
}

// prepared counts one prepare of namespace ns.
func (m *cacheMetrics) prepared(ns string, res *api.PrepareResult) {
	if res.FetchedBytes == 0 {
		m.hits.WithLabelValues(ns).Inc()
	} else {
		m.misses.WithLabelValues(ns).Inc()
		m.fetched.WithLabelValues(ns).Add(float64(res.FetchedBytes))
	}
	if n := len(res.Evicted); n > 0 {
		m.evictions.WithLabelValues(ns).Add(float64(n))
	}
}

// heldBytes reports, at each scrape, the allocated bytes of every
// namespace's RAM cache (files and kept device states): read from the
// caches themselves, so that it is right after a restart too.
type heldBytes struct {
	stateDir string
	desc     *prometheus.Desc
}

func newHeldBytes(stateDir string) heldBytes {
	return heldBytes{stateDir: stateDir, desc: prometheus.NewDesc("vmsnap_ram_cache_bytes",
		"Allocated bytes the namespace's RAM cache holds (files and the device states kept beside them).", []string{"namespace"}, nil)}
}

func (h heldBytes) Describe(ch chan<- *prometheus.Desc) { ch <- h.desc }

func (h heldBytes) Collect(ch chan<- prometheus.Metric) {
	des, _ := os.ReadDir(filepath.Join(h.stateDir, "ram"))
	for _, de := range des {
		if !de.IsDir() || !isDNSLabel(de.Name()) {
			continue
		}
		entries, err := ramfile.Cache{Dir: RAMCacheDir(h.stateDir, de.Name())}.List()
		if err != nil {
			continue
		}
		var total int64
		for _, e := range entries {
			total += e.Bytes
		}
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, float64(total), de.Name())
	}
}
