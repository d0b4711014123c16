package vendors

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"
)

// stripeFake answers as Stripe documents its limiters (docs/VENDORS.md
// has the sources): a rate limiter of global operations a second in all
// and endpoint a second per endpoint (each named operation: its method
// and its path, ids left out), and a concurrency limiter of inFlight
// requests at once, whose figure Stripe does not publish. A refusal is a
// 429 whose Stripe-Rate-Limited-Reason says which limiter refused it.
type stripeFake struct {
	global, endpoint, inFlight int
	latency                    map[string]time.Duration // by endpoint

	counts  *counts
	mu      sync.Mutex
	flying  int
	most    int
	refused map[string]int // after the first second, by reason
	early   int
}

func newStripeFake(global, endpoint, inFlight int, latency map[string]time.Duration) *stripeFake {
	return &stripeFake{global: global, endpoint: endpoint, inFlight: inFlight, latency: latency, counts: newCounts(), refused: map[string]int{}}
}

// stripeEndpoint names the operation of r: its method and its path with
// the object's id left out.
func stripeEndpoint(r *http.Request) string {
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if len(parts) > 2 {
		parts = parts[:2]
		parts = append(parts, "{id}")
	}
	return r.Method + " /" + strings.Join(parts, "/")
}

func (v *stripeFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	ep := stripeEndpoint(r)
	v.mu.Lock()
	v.flying++
	v.most = max(v.most, v.flying)
	over := v.flying > v.inFlight
	v.mu.Unlock()
	defer func() {
		v.mu.Lock()
		v.flying--
		v.mu.Unlock()
	}()
	reason := ""
	if over {
		reason = "global-concurrency"
	} else {
		switch v.counts.take(now, map[string]int{"global": 1, ep: 1},
			map[string]limit{"global": {v.global, time.Second}, ep: {v.endpoint, time.Second}}) {
		case "global":
			reason = "global-rate"
		case ep:
			reason = "endpoint-rate"
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Request-Id", "req_1")
	if reason != "" {
		v.mu.Lock()
		if now.Sub(v.counts.start) < 2*time.Second {
			v.early++
		} else {
			v.refused[reason]++
		}
		v.mu.Unlock()
		w.Header().Set("Stripe-Rate-Limited-Reason", reason)
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"error":{"code":"rate_limit","doc_url":"https://stripe.com/docs/error-codes/rate-limit","message":"Request rate limit exceeded.","type":"invalid_request_error"}}`)
		return
	}
	time.Sleep(v.latency[ep])
	switch {
	case strings.Contains(ep, "customers"):
		fmt.Fprint(w, `{"id":"cus_1","object":"customer"}`)
	case strings.Contains(ep, "refunds"):
		fmt.Fprint(w, `{"id":"re_1","object":"refund","amount":100}`)
	default:
		fmt.Fprint(w, `{"id":"pi_1","object":"payment_intent","amount":100,"currency":"usd"}`)
	}
}

func (v *stripeFake) serve() *httptest.Server { return httptest.NewServer(v) }
