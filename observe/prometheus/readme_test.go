package prometheus_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	throttleprom "github.com/throttlekit/throttle/observe/prometheus"
	"github.com/throttlekit/throttle/policies"
)

// readmeWiring is observe/README.md's Prometheus snippet (the root
// module's readme_test.go checks that the README shows it as it is here).
func readmeWiring(rdb *redis.Client, policy policies.Policy, mux *http.ServeMux) (*throttle.Limiter, error) {
	// README prometheus
	obs := throttleprom.New() // a prometheus.Collector; obs.Observe is the Options.Observer
	reg := prometheus.NewRegistry()
	if err := reg.Register(obs); err != nil {
		return nil, err
	}
	lim, err := throttle.New(rdb, "twilio-sms", policy, throttle.Options{Observer: obs.Observe})
	if err != nil {
		return nil, err
	}
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// README end
	return lim, nil
}

func TestREADME_PrometheusSnippetRuns(t *testing.T) {
	_, rdb := newRedis(t)
	mux := http.NewServeMux()
	lim, err := readmeWiring(rdb, policies.SlidingLog{Limit: 10, Window: time.Second}, mux)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lim.Allow(context.Background()); err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if !strings.Contains(rec.Body.String(), `throttle_calls_total{outcome="admitted",quota="twilio-sms",shadow="false"} 1`) {
		t.Errorf("the snippet's /metrics does not count the call:\n%s", rec.Body.String())
	}
}
