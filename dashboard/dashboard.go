// Package dashboard serves one web page that shows every quota a Redis
// holds, as the fleet's limiters see it: each rule's use, bookings and
// limit in force (a cap learned from the vendor, the share left to other
// consumers of the vendor's key), pauses and why, when the quota's data
// began and was last lost, a sparkline of its recent use, and, for quotas
// with per-key rules, their busiest keys.
//
// Mount the Handler on an admin mux; it reads Redis and never writes to
// it. The page is rendered on the server, figures included, and redraws
// itself every Options.Refresh from the same data as JSON (add
// ?format=json to its URL).
package dashboard

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
)

// Options configure a Handler. The zero value is usable.
type Options struct {
	// Prefix is the prefix of the quotas' keys, as the fleet's
	// throttle.Options.Prefix; "" for the default.
	Prefix string
	// Refresh is how often the page redraws itself; 2s when 0.
	Refresh time.Duration
	// History is how far back the sparklines reach; 5m when 0.
	History time.Duration
	// Keys is how many of a per-key quota's busiest keys the page shows;
	// 5 when 0.
	Keys int
}

// Defaults of Options left zero.
const (
	DefaultRefresh = 2 * time.Second
	DefaultHistory = 5 * time.Minute
	DefaultKeys    = 5
)

const (
	// readTimeout bounds one refresh's reads of Redis.
	readTimeout = 5 * time.Second
	// reopenEvery is how often a quota's cached limiter is opened again,
	// so that the page follows a policy the fleet deploys.
	reopenEvery = time.Minute
	// readsAtOnce bounds the quotas a refresh reads at once.
	readsAtOnce = 8
	// maxRingLength bounds the samples of a quota's sparkline.
	maxRingLength = 2000
)

// Handler serves the dashboard: the HTML page on GET, and its data as JSON
// with ?format=json. It is safe for concurrent use; requests that come
// within half a Refresh of a read share it, so any number of open pages
// read Redis once per half Refresh at most, and each quota with one Usage
// script call (and, with per-key rules, one BusiestKeys) per read. It only
// reads: it never takes a call, pauses or tells a quota anything. Make one
// with New.
//
// It keeps in memory, for each quota listed, the limiter Open made of it
// (which holds nothing in Redis, so it is never closed) and the samples of
// its sparkline; both are dropped when the quota is no longer listed.
type Handler struct {
	rdb  redis.UniversalClient
	opts Options

	readMu sync.Mutex // held while a refresh reads Redis: one read at a time
	last   *snapshot  // the last read; guarded by readMu

	mu        sync.Mutex                          // guards limiters and histories
	limiters  map[throttle.QuotaName]*openedQuota // Open's limiters, by quota
	histories map[throttle.QuotaName]*history     // the sparklines' samples, by quota
}

// openedQuota is a limiter Open made, and when.
type openedQuota struct {
	lim    *throttle.Limiter
	opened time.Time
}

// New returns a Handler that shows the quotas rdb holds under
// opts.Prefix. rdb is a *redis.Client or *redis.ClusterClient (the quotas
// are listed with SCAN on each master).
func New(rdb redis.UniversalClient, opts Options) *Handler {
	if opts.Refresh <= 0 {
		opts.Refresh = DefaultRefresh
	}
	if opts.History <= 0 {
		opts.History = DefaultHistory
	}
	if opts.Keys <= 0 {
		opts.Keys = DefaultKeys
	}
	return &Handler{
		rdb:       rdb,
		opts:      opts,
		limiters:  map[throttle.QuotaName]*openedQuota{},
		histories: map[throttle.QuotaName]*history{},
	}
}

// ServeHTTP serves the page, or its data as JSON for ?format=json, at
// whatever path the Handler is mounted. Only GET and HEAD are served. When
// the quotas cannot be listed, the page says why with status 503.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "dashboard: only GET and HEAD", http.StatusMethodNotAllowed)
		return
	}
	s := h.refresh(r.Context())
	status := http.StatusOK
	if s.Error != "" {
		status = http.StatusServiceUnavailable
	}
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if r.URL.Query().Get("format") == "json" {
		writeJSON(w, status, s)
		return
	}
	writePage(w, status, s)
}

// refresh returns a snapshot of the quotas: the last one when it is newer
// than half a Refresh, or a new read. The read outlives a request that
// gives up, since others may wait for it, but not readTimeout.
func (h *Handler) refresh(ctx context.Context) *snapshot {
	h.readMu.Lock()
	defer h.readMu.Unlock()
	if h.last != nil && time.Since(h.last.taken) < h.opts.Refresh/2 {
		return h.last
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), readTimeout)
	defer cancel()
	h.last = h.read(ctx)
	return h.last
}
