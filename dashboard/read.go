package dashboard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// snapshot is what one refresh read of every quota: the page's data, and
// its JSON.
type snapshot struct {
	Taken     string      `json:"taken"` // when it was read, RFC 3339
	Prefix    string      `json:"prefix"`
	RefreshMS int64       `json:"refresh_ms"`
	Refresh   string      `json:"refresh"`
	History   string      `json:"history"`
	Error     string      `json:"error,omitempty"` // why the quotas could not be listed
	Quotas    []quotaView `json:"quotas"`

	taken time.Time
}

// quotaView is one quota as the page shows it. Durations and times are
// formatted here, so that the page's script only places them.
type quotaView struct {
	Name      string     `json:"name"`
	Group     string     `json:"group,omitempty"`
	Note      string     `json:"note,omitempty"` // why the figures are missing
	Paused    bool       `json:"paused"`
	PausedMS  int64      `json:"paused_ms"`
	PausedFor string     `json:"paused_for,omitempty"`
	PausedBy  string     `json:"paused_by,omitempty"`
	Since     string     `json:"since,omitempty"` // RFC 3339
	SinceText string     `json:"since_text,omitempty"`
	LastLoss  string     `json:"last_loss,omitempty"` // RFC 3339, "" for never
	LossText  string     `json:"last_loss_text,omitempty"`
	Spread    string     `json:"spread,omitempty"`
	Remaining int        `json:"remaining"` // under the rules shared by every key
	Rules     []ruleView `json:"rules"`
	Spark     sparkView  `json:"spark"`
	PerKey    bool       `json:"per_key"`
	Keys      []keyView  `json:"keys,omitempty"` // the busiest keys, fullest first
	KeysNote  string     `json:"keys_note,omitempty"`
}

// ruleView is one rule of a quota. A per-key rule's figures are its
// busiest keys' (keyView), not its own.
type ruleView struct {
	Index      int    `json:"index"`
	Kind       string `json:"kind"`
	Spec       string `json:"spec"`            // its limit and window, interval or lease
	Scope      string `json:"scope,omitempty"` // per key, per call, its unit, its group
	PerKey     bool   `json:"per_key"`
	Configured int    `json:"configured"` // the limit as configured
	Used       int    `json:"used"`
	Booked     int    `json:"booked"`
	Limit      int    `json:"limit"`  // the limit in force
	Others     int    `json:"others"` // units left to other consumers of the vendor's key
	Capped     bool   `json:"capped"` // Limit is a cap learned from the vendor
	Margin     string `json:"margin,omitempty"`
	NextFree   string `json:"next_free,omitempty"`
	Fill       int    `json:"fill"` // used and booked, in percent of Limit
}

// keyView is one of a per-key quota's busiest keys.
type keyView struct {
	Hash  string `json:"hash"`
	Used  int    `json:"used"`
	Limit int    `json:"limit"`
	Fill  int    `json:"fill"`
}

// read lists the quotas and reads each, readsAtOnce at a time, then
// samples their sparklines.
func (h *Handler) read(ctx context.Context) *snapshot {
	now := time.Now()
	s := &snapshot{
		taken: now, Taken: now.UTC().Format(time.RFC3339), Prefix: h.opts.Prefix,
		RefreshMS: h.opts.Refresh.Milliseconds(), Refresh: human(h.opts.Refresh), History: human(h.opts.History),
	}
	names, err := throttle.Quotas(ctx, h.rdb, h.opts.Prefix)
	if err != nil {
		s.Error = err.Error()
		return s
	}
	s.Quotas = make([]quotaView, len(names))
	used := make([]sample, len(names))
	var wg sync.WaitGroup
	sem := make(chan struct{}, readsAtOnce)
	for i, q := range names {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			s.Quotas[i], used[i] = h.readQuota(ctx, q, now)
		})
	}
	wg.Wait()
	h.sample(names, used, s.Quotas, now)
	return s
}

// readQuota reads quota q: one Usage script call, and for per-key rules
// BusiestKeys. It returns the quota's view, and the sample of its
// sparkline (at the zero time when there is none).
func (h *Handler) readQuota(ctx context.Context, q throttle.QuotaName, now time.Time) (quotaView, sample) {
	v := quotaView{Name: q.Name, Group: q.Group}
	lim, err := h.limiter(ctx, q, now)
	if errors.Is(err, throttle.ErrNotDescribed) {
		v.Note = "No description of its policy is stored with the quota yet (its fleet's next call stores it, or the fleet runs a version that does not): its figures cannot be read."
		return v, sample{}
	}
	if err != nil {
		v.Note = "Cannot open the quota: " + err.Error()
		return v, sample{}
	}
	v.PerKey = slices.ContainsFunc(lim.Rules(), func(r policies.Rule) bool { return r.PerKey })
	var opts []throttle.CallOption
	if v.PerKey {
		// Usage asks a per-key quota for a key: the empty one reads the
		// shared rules, and its own per-key counts, which are ignored.
		opts = append(opts, throttle.Key(""))
	}
	u, err := lim.Usage(ctx, opts...)
	if err != nil {
		v.Note = "Cannot read the quota's usage: " + err.Error()
		return v, sample{}
	}
	fillUsage(&v, u, now)
	if v.PerKey {
		h.readKeys(ctx, lim, &v)
	}
	s := sparkSample(&v, now)
	return v, s
}

// limiter returns the cached limiter of quota q, opened again when it is
// older than reopenEvery. A quota without a description is not cached:
// its fleet may describe it at its next call.
func (h *Handler) limiter(ctx context.Context, q throttle.QuotaName, now time.Time) (*throttle.Limiter, error) {
	h.mu.Lock()
	o := h.limiters[q]
	h.mu.Unlock()
	if o != nil && now.Sub(o.opened) < reopenEvery {
		return o.lim, nil
	}
	lim, err := throttle.Open(ctx, h.rdb, q, throttle.Options{Prefix: h.opts.Prefix})
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	h.limiters[q] = &openedQuota{lim: lim, opened: now}
	h.mu.Unlock()
	return lim, nil
}

// fillUsage sets the figures of v from u.
func fillUsage(v *quotaView, u throttle.Usage, now time.Time) {
	if u.Paused > 0 {
		v.Paused, v.PausedMS, v.PausedFor, v.PausedBy = true, u.Paused.Milliseconds(), human(u.Paused), u.PausedBy
		if v.PausedBy == "" {
			v.PausedBy = "unknown"
		}
	}
	if !u.Since.IsZero() {
		v.Since, v.SinceText = u.Since.UTC().Format(time.RFC3339), ago(u.Since, now)
	}
	if !u.LastLoss.IsZero() {
		v.LastLoss, v.LossText = u.LastLoss.UTC().Format(time.RFC3339), ago(u.LastLoss, now)
	}
	v.Spread = human(u.Spread)
	v.Remaining = -1
	for i, ru := range u.Rules {
		r := ruleOf(i, ru)
		v.Rules = append(v.Rules, r)
		if !r.PerKey && (v.Remaining < 0 || ru.Remaining < v.Remaining) {
			v.Remaining = ru.Remaining
		}
	}
}

// ruleOf returns the view of rule i, as u reads it.
func ruleOf(i int, u throttle.RuleUsage) ruleView {
	r := u.Rule
	v := ruleView{Index: i, Kind: r.Kind.String(), Spec: spec(r), Scope: scopeOf(r), PerKey: r.PerKey, Configured: r.Limit}
	if r.PerKey {
		return v
	}
	v.Used, v.Booked, v.Limit, v.Others = u.Used, u.Booked, u.Limit, u.Others
	v.Capped = u.Limit < r.Limit && u.Others == 0
	v.Fill = percent(u.Used+u.Booked, u.Limit)
	if u.Margin > 0 {
		v.Margin = human(u.Margin)
	}
	if u.NextFree > 0 {
		v.NextFree = human(u.NextFree)
	}
	return v
}

// readKeys sets the busiest keys of v, a per-key quota.
func (h *Handler) readKeys(ctx context.Context, lim *throttle.Limiter, v *quotaView) {
	keys, err := lim.BusiestKeys(ctx, h.opts.Keys)
	if err != nil {
		v.KeysNote = "Cannot read the busiest keys: " + err.Error()
		return
	}
	if len(keys) == 0 {
		v.KeysNote = "No key has calls in its window."
	}
	for _, k := range keys {
		v.Keys = append(v.Keys, keyView{Hash: k.Hash, Used: k.Used, Limit: k.Limit, Fill: percent(k.Used, k.Limit)})
	}
}

// spec says what rule r admits: its limit and its window, interval or
// lease.
func spec(r policies.Rule) string {
	switch r.Kind {
	case policies.KindSlidingLog:
		return fmt.Sprintf("%d per %s", r.Limit, human(r.Window-r.Margin))
	case policies.KindSlidingCounter:
		return fmt.Sprintf("%d per %s, buckets of %s", r.Limit, human(r.Window-r.Margin), human(r.Bucket))
	case policies.KindTokenBucket:
		return fmt.Sprintf("burst %d, 1 per %s", r.Limit, human(r.Every))
	case policies.KindConcurrency:
		return fmt.Sprintf("%d in flight, lease %s", r.Limit, human(r.Lease))
	}
	return fmt.Sprintf("limit %d", r.Limit)
}

// scopeOf says what rule r counts, and for whom.
func scopeOf(r policies.Rule) string {
	var s []string
	if r.PerKey {
		s = append(s, "per key")
	}
	if r.PerCall {
		s = append(s, "per call")
	}
	if r.Unit != "" {
		s = append(s, "unit "+r.Unit)
	}
	if r.Shared != "" {
		s = append(s, "shared by "+r.Shared)
	}
	return joinDot(s)
}
