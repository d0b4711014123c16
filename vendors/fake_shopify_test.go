package vendors

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"
)

// shopifyFake answers the GraphQL Admin API as Shopify documents it
// (docs/VENDORS.md has the sources): a leaky bucket of points per app and
// store, of max points restored at restore a second; a query needs room
// for its requested cost before it runs (a products(first: n) query asks
// n + 2), is charged it, and is refunded what its actual cost left over
// when it ends (its results: 2 + up to n); each answer states both costs
// and the bucket in extensions.cost; a query without room is THROTTLED,
// in a 200.
type shopifyFake struct {
	max, restore float64
	latency      time.Duration

	mu      sync.Mutex
	level   float64 // points in the bucket
	at      time.Time
	start   time.Time
	rng     *rand.Rand
	actual  []int // actual points charged, per second of the run
	refused int   // after the first window, the time the bucket takes to empty
	early   int
	most    float64 // the bucket's fullest
}

func newShopifyFake(max, restore int, latency time.Duration) *shopifyFake {
	now := time.Now()
	return &shopifyFake{max: float64(max), restore: float64(restore), latency: latency, at: now, start: now, rng: rand.New(rand.NewPCG(3, 4))}
}

// drain leaks the bucket up to now; v.mu is held.
func (v *shopifyFake) drain(now time.Time) {
	v.level = max(0, v.level-v.restore*now.Sub(v.at).Seconds())
	v.at = now
}

func (v *shopifyFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var b struct {
		Variables struct{ First int } `json:"variables"`
	}
	body, _ := io.ReadAll(r.Body)
	if json.Unmarshal(body, &b) != nil {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	requested := float64(b.Variables.First + 2)
	w.Header().Set("Content-Type", "application/json")
	now := time.Now()
	v.mu.Lock()
	v.drain(now)
	if v.max-v.level < requested {
		if now.Sub(v.start) < time.Duration(v.max/v.restore*float64(time.Second)) {
			v.early++
		} else {
			v.refused++
		}
		available := v.max - v.level
		v.mu.Unlock()
		fmt.Fprintf(w, `{"errors":[{"message":"Throttled","extensions":{"code":"THROTTLED","documentation":"https://shopify.dev/api/usage/rate-limits"}}],`+
			`"extensions":{"cost":{"requestedQueryCost":%d,"actualQueryCost":null,"throttleStatus":{"maximumAvailable":%.1f,"currentlyAvailable":%d,"restoreRate":%.1f}}}}`,
			int(requested), v.max, int(available), v.restore)
		return
	}
	v.level += requested
	v.most = max(v.most, v.level)
	actual := 2 + v.rng.IntN(b.Variables.First+1)
	v.mu.Unlock()
	time.Sleep(v.latency)
	v.mu.Lock()
	now = time.Now()
	v.drain(now)
	v.level = max(0, v.level-(requested-float64(actual))) // the refund
	k := int(now.Sub(v.start) / time.Second)
	for len(v.actual) <= k {
		v.actual = append(v.actual, 0)
	}
	v.actual[k] += actual
	available := v.max - v.level
	v.mu.Unlock()
	fmt.Fprintf(w, `{"data":{"products":{"nodes":[]}},"extensions":{"cost":{"requestedQueryCost":%d,"actualQueryCost":%d,`+
		`"throttleStatus":{"maximumAvailable":%.1f,"currentlyAvailable":%d,"restoreRate":%.1f}}}}`,
		int(requested), actual, v.max, int(available), v.restore)
}

// results returns the refusals after the first window and in it, and the
// actual points charged in the seconds after the first window as a share
// of what the bucket restores in them.
func (v *shopifyFake) results(d time.Duration) (refused, early int, share float64, perSecond []int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	first := int(v.max / v.restore)
	seconds := int(d / time.Second)
	sum := 0
	for k := first; k < seconds && k < len(v.actual); k++ {
		sum += v.actual[k]
	}
	return v.refused, v.early, float64(sum) / (v.restore * float64(seconds-first)), append([]int(nil), v.actual...)
}

func (v *shopifyFake) serve() *httptest.Server { return httptest.NewServer(v) }
