package otel_test

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"

	"github.com/throttlekit/throttle"
	throttleotel "github.com/throttlekit/throttle/observe/otel"
	"github.com/throttlekit/throttle/policies"
)

// readmeWiring is observe/README.md's OpenTelemetry snippet (the root
// module's readme_test.go checks that the README shows it as it is here).
func readmeWiring(rdb *redis.Client, policy policies.Policy) (*throttle.Limiter, error) {
	// README otel
	obs, err := throttleotel.New(otel.Meter("github.com/throttlekit/throttle"))
	if err != nil {
		return nil, err
	}
	lim, err := throttle.New(rdb, "twilio-sms", policy, throttle.Options{Observer: obs.Observe})
	if err != nil {
		return nil, err
	}
	// README end
	return lim, nil
}

func TestREADME_OTelSnippetRuns(t *testing.T) {
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	lim, err := readmeWiring(rdb, policies.SlidingLog{Limit: 10, Window: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if d, err := lim.Allow(context.Background()); err != nil || !d.OK {
		t.Fatalf("a call through the snippet's limiter: %+v, %v", d, err)
	}
}
