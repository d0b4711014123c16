package dashboard

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"html"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// fleet is what the quotas' own limiters made of them, for the page to
// show: the cap the vendor taught one, and the keys of the per-key quota,
// busiest first.
type fleet struct {
	capped    int      // the "capped" quota's limit in force
	keyHashes []string // the "tenants" quota's keys, busiest first
	keyUsed   []int
}

// slack is the margin of the fleet's quotas: a call starts late in its
// slot by up to half of it, so that a reply of miniredis under -race beside
// CI's other work (tens of milliseconds late, four times running) does not
// refuse a call of an empty quota as too late to start in.
const slack = time.Second

// startFleet fills rdb with the quotas the page shows: "saturated", a log
// of 10 a minute with its 10 calls; "paused", paused for an hour by the
// vendor; "capped", which learned a cap from a refusal; "tenants", with
// per-key rules and three keys of different loads; and "undescribed",
// whose meta holds no description of its policy.
func startFleet(t *testing.T, rdb redis.UniversalClient) fleet {
	t.Helper()
	ctx := context.Background()
	var f fleet
	saturated := newLimiter(t, rdb, "saturated", policies.SlidingLog{Limit: 10, Window: time.Minute, Margin: slack})
	for i := range 10 {
		if _, err := saturated.Acquire(ctx); err != nil {
			t.Fatalf("saturated: call %d: %v", i+1, err)
		}
	}
	paused := newLimiter(t, rdb, "paused", policies.SlidingLog{Limit: 100, Window: time.Second, Margin: slack})
	if _, err := paused.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	if err := paused.Pause(ctx, time.Hour); err != nil {
		t.Fatal(err)
	}
	f.capped = learnCap(t, newLimiter(t, rdb, "capped", policies.SlidingLog{Limit: 100, Window: time.Minute, Margin: slack}))
	tenants := policies.All(
		policies.SlidingLog{Limit: 1000, Window: time.Minute, Margin: slack},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Minute, Margin: slack}},
	)
	loads := []struct {
		key string
		n   int
	}{{"tenant-b", 7}, {"tenant-c", 4}, {"tenant-a", 2}}
	for _, l := range loads {
		for range l.n {
			// A limiter per call takes no spare admissions: the quota holds
			// the calls alone.
			lim := newLimiter(t, rdb, "tenants", tenants)
			if _, err := lim.Acquire(ctx, throttle.Key(l.key)); err != nil {
				t.Fatal(err)
			}
		}
		f.keyHashes = append(f.keyHashes, keyHash(l.key))
		f.keyUsed = append(f.keyUsed, l.n)
	}
	if err := rdb.HSet(ctx, "throttle:{undescribed}:meta", "epoch", 1).Err(); err != nil {
		t.Fatal(err)
	}
	return f
}

// learnCap makes lim's quota learn a cap: a call, which the vendor
// refuses. It returns the cap, which Usage reads below the configured
// limit.
func learnCap(t *testing.T, lim *throttle.Limiter) int {
	t.Helper()
	ctx := context.Background()
	p, err := lim.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Heard(ctx, throttle.Answer{Status: http.StatusTooManyRequests, RetryAfter: time.Millisecond, HasRetryAfter: true, AboutRate: true}); err != nil {
		t.Fatal(err)
	}
	p.Release()
	u, err := lim.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r := u.Rules[0]; r.Limit >= r.Rule.Limit || r.Others != 0 {
		t.Fatalf("after a refusal, Usage reads a limit of %d of %d (others %d): no cap learned", r.Limit, r.Rule.Limit, r.Others)
	}
	return u.Rules[0].Limit
}

func newLimiter(t *testing.T, rdb redis.UniversalClient, name string, p policies.Policy) *throttle.Limiter {
	t.Helper()
	lim, err := throttle.New(rdb, name, p) // Block: a reply later than the margin books again, on a busy machine too
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lim.Close(context.Background()) })
	return lim
}

// keyHash is the hash a key's Redis keys carry, as BusiestKeys names it.
func keyHash(k string) string {
	sum := sha256.Sum256([]byte(k))
	return base64.RawURLEncoding.EncodeToString(sum[:16])
}

// checkPage checks the figures of the page's HTML: each quota's, as
// startFleet made them.
func checkPage(t *testing.T, page string, f fleet) {
	t.Helper()
	qs := quotas(page)
	for _, name := range []string{"saturated", "paused", "capped", "tenants", "undescribed"} {
		if qs[name] == nil {
			t.Fatalf("no section.quota[data-quota=%q] in the page:\n%s", name, page)
		}
	}
	sat := qs["saturated"]
	if used := sat.find("td", "used", "data-rule", "0").text; used != "10" {
		t.Errorf("saturated: used %q, want 10", used)
	}
	if lim := sat.find("td", "limit", "data-rule", "0"); lim.attrs["data-limit"] != "10" || lim.attrs["data-configured"] != "10" || lim.attrs["data-capped"] != "false" {
		t.Errorf("saturated: limit %v, want 10 of 10, no cap", lim.attrs)
	}
	pause := qs["paused"].find("span", "pause")
	if ms, _ := strconv.Atoi(pause.attrs["data-paused-ms"]); pause.attrs["data-paused-by"] != "vendor" || ms < 59*60*1000 {
		t.Errorf("paused: pause %v %q, want an hour by the vendor", pause.attrs, pause.text)
	}
	if !strings.Contains(pause.text, "vendor") {
		t.Errorf("paused: the pause reads %q, want its cause", pause.text)
	}
	capped := qs["capped"].find("td", "limit", "data-rule", "0")
	if want := strconv.Itoa(f.capped); capped.attrs["data-limit"] != want || capped.attrs["data-configured"] != "100" || capped.attrs["data-capped"] != "true" || capped.text != want {
		t.Errorf("capped: limit %v %q, want %s of 100, a learned cap", capped.attrs, capped.text, want)
	}
	if qs["capped"].find("span", "cap").tag == "" {
		t.Error("capped: no span.cap marks the learned cap")
	}
	var hashes, used []string
	for _, e := range qs["tenants"] {
		switch {
		case e.tag == "tr" && e.attrs["class"] == "key":
			hashes = append(hashes, e.attrs["data-hash"])
		case e.tag == "td" && e.attrs["class"] == "used" && len(hashes) > len(used):
			used = append(used, e.text)
		}
	}
	var wantUsed []string
	for _, n := range f.keyUsed {
		wantUsed = append(wantUsed, strconv.Itoa(n))
	}
	if !slices.Equal(hashes, f.keyHashes) || !slices.Equal(used, wantUsed) {
		t.Errorf("tenants: busiest keys %v used %v, want %v used %v", hashes, used, f.keyHashes, wantUsed)
	}
	if note := qs["undescribed"].find("p", "note").text; !strings.Contains(note, "No description") {
		t.Errorf("undescribed: note %q, want one saying its policy is not described", note)
	}
}

// The page shows every quota's figures, rendered on the server: a full
// log, a pause and its cause, a learned cap, a per-key quota's busiest
// keys, and a quota without a description, noted; its JSON says the
// same.
func TestHandler_ShowsEachQuotasFigures(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		f := startFleet(t, rdb)
		h := New(rdb, Options{})
		page, status := get(t, h, "/")
		if status != http.StatusOK {
			t.Fatalf("GET /: status %d\n%s", status, page)
		}
		checkPage(t, page, f)

		body, status := get(t, h, "/?format=json")
		if status != http.StatusOK {
			t.Fatalf("GET /?format=json: status %d\n%s", status, body)
		}
		var snap snapshot
		if err := json.Unmarshal([]byte(body), &snap); err != nil {
			t.Fatal(err)
		}
		byName := map[string]quotaView{}
		for _, q := range snap.Quotas {
			byName[q.Name] = q
		}
		if r := byName["saturated"].Rules[0]; r.Used != 10 || r.Limit != 10 || r.Fill != 100 {
			t.Errorf("JSON: saturated rule %+v, want 10 used of 10", r)
		}
		if q := byName["paused"]; !q.Paused || q.PausedBy != throttle.PausedByVendor {
			t.Errorf("JSON: paused %v by %q, want paused by the vendor", q.Paused, q.PausedBy)
		}
		if r := byName["capped"].Rules[0]; r.Limit != f.capped || r.Configured != 100 || !r.Capped {
			t.Errorf("JSON: capped rule %+v, want a learned cap of %d", r, f.capped)
		}
		if q := byName["tenants"]; len(q.Keys) != 3 || q.Keys[0].Hash != f.keyHashes[0] || q.Keys[0].Used != 7 || !q.Rules[1].PerKey {
			t.Errorf("JSON: tenants %+v, want its busiest key %s with 7 used", q, f.keyHashes[0])
		}
		if q := byName["undescribed"]; q.Note == "" || len(q.Rules) != 0 {
			t.Errorf("JSON: undescribed %+v, want a note and no figures", q)
		}
	})
}

// Each refresh the Handler serves samples the sparklines; requests within
// half a Refresh share one read.
func TestHandler_SamplesTheSparklineEachRefresh(t *testing.T) {
	rdb := redistest.Mini(t).Client(t)
	startFleet(t, rdb)
	spark := func(h *Handler) sparkView {
		t.Helper()
		var snap snapshot
		body, _ := get(t, h, "/?format=json")
		if err := json.Unmarshal([]byte(body), &snap); err != nil {
			t.Fatal(err)
		}
		for _, q := range snap.Quotas {
			if q.Name == "saturated" {
				return q.Spark
			}
		}
		t.Fatal("no quota saturated in the JSON")
		return sparkView{}
	}
	h := New(rdb, Options{Refresh: 20 * time.Millisecond})
	var got sparkView
	for range 4 {
		got = spark(h)
		time.Sleep(15 * time.Millisecond)
	}
	if got.Samples != 4 || len(strings.Fields(got.Points)) != 4 || got.Last != 10 || got.Max != 10 {
		t.Errorf("after 4 refreshes, the sparkline is %+v, want 4 samples of 10 out of 10", got)
	}
	shared := New(rdb, Options{Refresh: time.Minute})
	spark(shared)
	if got := spark(shared); got.Samples != 1 {
		t.Errorf("two requests within half a Refresh: %d samples, want the one read's", got.Samples)
	}
}

// The page only reads: serving it changes nothing in Redis (Redis counts
// every write in rdb_changes_since_last_save).
func TestHandler_WritesNothing(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		startFleet(t, rdb)
		state := func() string {
			if s.Mini != nil {
				return s.Mini.Dump()
			}
			info, err := rdb.Info(context.Background(), "persistence").Result()
			if err != nil {
				t.Fatal(err)
			}
			return regexp.MustCompile(`rdb_changes_since_last_save:\d+`).FindString(info)
		}
		before := state()
		h := New(rdb, Options{Refresh: time.Millisecond})
		for range 3 {
			get(t, h, "/")
			get(t, h, "/?format=json")
		}
		if after := state(); after != before {
			t.Errorf("Redis changed while the page was served:\n%s\nthen\n%s", before, after)
		}
	})
}

// A Redis that cannot be read is said on the page, with status 503, and
// only GET and HEAD are served.
func TestHandler_SaysWhatFails(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	defer rdb.Close()
	h := New(rdb, Options{})
	page, status := get(t, h, "/")
	if status != http.StatusServiceUnavailable || !strings.Contains(page, "Quotas") {
		t.Errorf("GET / with Redis down: status %d, want 503 and the error on the page:\n%s", status, page)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/", nil))
	if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != "GET, HEAD" {
		t.Errorf("POST /: status %d, Allow %q; want 405 and GET, HEAD", rec.Code, rec.Header().Get("Allow"))
	}
}

// The page renders in a real browser, with the figures in the DOM before
// its script redraws them, and again after it has (from the JSON); a
// screenshot of it is a PNG of some size. Set DASHBOARD_SCREENSHOT to a
// path to keep the screenshot (docs/dashboard.png is one).
func TestPage_RendersInChromium(t *testing.T) {
	bin := chromium(t)
	rdb := redistest.Real(t).Client(t)
	f := startFleet(t, rdb)

	// A minute's refresh: the dump is of the page as the server rendered it.
	still := httptest.NewServer(New(rdb, Options{Refresh: time.Minute}))
	defer still.Close()
	dom := runChromium(t, bin, "--dump-dom", still.URL)
	if !strings.Contains(dom, `data-drawn="0"`) {
		t.Fatalf("the page was redrawn before the dump: not the server's rendering")
	}
	checkPage(t, dom, f)

	// Virtual time runs the script's timers: the dump is of its redraws.
	polling := httptest.NewServer(New(rdb, Options{Refresh: 300 * time.Millisecond}))
	defer polling.Close()
	dom = runChromium(t, bin, "--virtual-time-budget=2000", "--dump-dom", polling.URL)
	if m := regexp.MustCompile(`data-drawn="(\d+)"`).FindStringSubmatch(dom); m == nil || m[1] == "0" {
		t.Fatalf("the page's script did not redraw it (data-drawn %v)", m)
	}
	checkPage(t, dom, f)

	shot := filepath.Join(t.TempDir(), "dashboard.png")
	runChromium(t, bin, "--window-size=1200,900", "--virtual-time-budget=1000", "--screenshot="+shot, still.URL)
	png, err := os.ReadFile(shot)
	if err != nil {
		t.Fatalf("no screenshot: %v", err)
	}
	if len(png) < 10_000 || !strings.HasPrefix(string(png), "\x89PNG") {
		t.Fatalf("the screenshot is %d bytes, want a PNG over 10 KB", len(png))
	}
	if keep := os.Getenv("DASHBOARD_SCREENSHOT"); keep != "" {
		if err := os.WriteFile(keep, png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// chromium returns the browser's binary, or skips the test without one
// (fails it when CI=true). The test is heavy: it starts the browser three
// times.
func chromium(t *testing.T) string {
	t.Helper()
	redistest.Heavy(t, "it starts a browser three times")
	for _, name := range []string{"/usr/bin/chromium", "chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("chromium not found (/usr/bin/chromium, chromium or chromium-browser on PATH), and CI=true requires it: install Debian's chromium (apt-get install -y chromium)")
	}
	t.Skip("chromium not found; skipping (install Debian's chromium to run this test; with CI=true this is a failure)")
	return ""
}

// chromiumTimeout bounds one run of the browser.
const chromiumTimeout = 60 * time.Second

// runChromium runs headless chromium with args and returns its output; it
// is killed, its children too, when it runs past chromiumTimeout.
func runChromium(t *testing.T, bin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), chromiumTimeout)
	defer cancel()
	base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--user-data-dir=" + t.TempDir()}
	cmd := exec.CommandContext(ctx, bin, append(base, args...)...)
	killGroupOnCancel(cmd)
	cmd.WaitDelay = 5 * time.Second
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("chromium ran past %v and was killed; its stderr:\n%s", chromiumTimeout, stderr.String())
	}
	if err != nil {
		t.Fatalf("chromium %v: %v; its stderr:\n%s", args, err, stderr.String())
	}
	return string(out)
}

// get serves a GET of target and returns the body and status.
func get(t *testing.T, h http.Handler, target string) (string, int) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, target, nil))
	b, err := io.ReadAll(rec.Result().Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b), rec.Code
}

// element is a start tag of the page, with the text that follows it up to
// the next tag.
type element struct {
	tag   string
	attrs map[string]string
	text  string
}

// quotaElements is the elements of one section.quota, in order.
type quotaElements []element

var (
	startTag  = regexp.MustCompile(`<([a-zA-Z0-9]+)((?:\s+[a-zA-Z0-9_:-]+(?:="[^"]*")?)*)\s*/?>([^<]*)`)
	attribute = regexp.MustCompile(`([a-zA-Z0-9_:-]+)(?:="([^"]*)")?`)
)

// quotas returns the elements of each section.quota of page, by its
// data-quota: the page as the server writes it, or as chromium dumps it.
func quotas(page string) map[string]quotaElements {
	out := map[string]quotaElements{}
	current := ""
	for _, m := range startTag.FindAllStringSubmatch(page, -1) {
		e := element{tag: strings.ToLower(m[1]), attrs: map[string]string{}, text: strings.TrimSpace(html.UnescapeString(m[3]))}
		for _, a := range attribute.FindAllStringSubmatch(m[2], -1) {
			e.attrs[a[1]] = html.UnescapeString(a[2])
		}
		if e.tag == "section" {
			current = e.attrs["data-quota"]
		}
		if current != "" {
			out[current] = append(out[current], e)
		}
	}
	return out
}

// all returns the elements of tag with class cls and, in pairs, the
// attributes given.
func (q quotaElements) all(tag, cls string, attrs ...string) []element {
	var out []element
next:
	for _, e := range q {
		if e.tag != tag || !strings.Contains(" "+e.attrs["class"]+" ", " "+cls+" ") {
			continue
		}
		for i := 0; i+1 < len(attrs); i += 2 {
			if e.attrs[attrs[i]] != attrs[i+1] {
				continue next
			}
		}
		out = append(out, e)
	}
	return out
}

// find returns the first of all, or the zero element.
func (q quotaElements) find(tag, cls string, attrs ...string) element {
	if es := q.all(tag, cls, attrs...); len(es) > 0 {
		return es[0]
	}
	return element{attrs: map[string]string{}}
}
