package vendors

import (
	"context"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/throttlekit/throttle/internal/redistest"
)

// stripeCall makes worker j's call: one endpoint per worker.
func stripeCall(ctx context.Context, sc *stripe.Client, j int) error {
	var err error
	switch j % 4 {
	case 0:
		_, err = sc.V1PaymentIntents.Create(ctx, &stripe.PaymentIntentCreateParams{Amount: stripe.Int64(100), Currency: stripe.String("usd")})
	case 1:
		_, err = sc.V1PaymentIntents.Retrieve(ctx, "pi_1", nil)
	case 2:
		_, err = sc.V1Customers.Retrieve(ctx, "cus_1", nil)
	default:
		_, err = sc.V1Refunds.Create(ctx, &stripe.RefundCreateParams{PaymentIntent: stripe.String("pi_1")})
	}
	return err
}

// The Stripe recipe through stripe-go against the fake, at Stripe's live
// figures: each endpoint's call goes out once, unrefused.
func TestREADME_StripeRecipeRuns(t *testing.T) {
	v := newStripeFake(100, 25, 20, nil)
	srv := v.serve()
	defer srv.Close()
	s := redistest.Mini(t)
	sc, err := readmeStripe(s.Client(t), "sk_live_x", stripe.String(srv.URL))
	if err != nil {
		t.Fatal(err)
	}
	for j := range 4 {
		if err := stripeCall(context.Background(), sc, j); err != nil {
			t.Fatal(err)
		}
	}
	if len(v.refused)+v.early != 0 {
		t.Errorf("refused %v, %d early; want none", v.refused, v.early)
	}
}

// A fleet of 3 × 10 stripe-go clients through the recipe, against a fake
// of Stripe's live limiters (100 a second in all, 25 per endpoint, and a
// concurrency limiter of 20 that refuses a 21st request in flight; a
// payment intent takes 150 ms, any other call 30 ms): after the first
// 2 s, no refusal of any limiter, and 0.9 or more of 100 a second.
func TestStripe_FleetKeepsTheRateAndTheConcurrencyLimiters(t *testing.T) {
	d := fleetRun(8*time.Second, 20*time.Second)
	v := newStripeFake(100, 25, 20, map[string]time.Duration{
		"POST /v1/payment_intents": 150 * time.Millisecond, "GET /v1/payment_intents/{id}": 30 * time.Millisecond,
		"GET /v1/customers/{id}": 30 * time.Millisecond, "POST /v1/refunds": 30 * time.Millisecond,
	})
	stripeFleet(t, v, "sk_live_x", d)
	// The rate from any moment (meanShare): each window's calls leave in a
	// burst a window and a margin after the last, and a fixed second that
	// the drifting burst straddles holds fewer (11 and 17 of 25).
	_, per := v.counts.share("global", d, time.Second)
	share := v.counts.meanShare("global", d, time.Second)
	v.mu.Lock()
	defer v.mu.Unlock()
	t.Logf("stripe-go: %.3f of 100 a second; per second %v; most in flight %d of %d; %d refusals in the first 2 s, after them %v",
		share, per, v.most, v.inFlight, v.early, v.refused)
	if len(v.refused) != 0 {
		t.Errorf("refusals after the first 2 s: %v, want none", v.refused)
	}
	if share < 0.9 {
		t.Errorf("%.3f of the global rate, want at least 0.9", share)
	}
}

// The recipe with a test key (a sandbox): 25 a second in all, which binds
// before any endpoint's 25. A fleet of 3 × 10 stripe-go clients against a
// fake of the sandbox's limiters: after the first 2 s no refusal, and 0.9
// or more of 25 a second; the live key's 100 would meet global-rate
// refusals at once.
func TestStripe_ATestKeyKeepsTheSandboxRate(t *testing.T) {
	d := fleetRun(8*time.Second, 20*time.Second)
	v := newStripeFake(25, 25, 20, map[string]time.Duration{"POST /v1/payment_intents": 150 * time.Millisecond})
	stripeFleet(t, v, "sk_test_x", d)
	_, per := v.counts.share("global", d, 2*time.Second)
	share := v.counts.meanShare("global", d, 2*time.Second) // as the live fleet's
	v.mu.Lock()
	defer v.mu.Unlock()
	t.Logf("stripe-go, a test key: %.3f of 25 a second; per second %v; %d refusals in the first 2 s, after them %v", share, per, v.early, v.refused)
	if len(v.refused) != 0 {
		t.Errorf("refusals after the first 2 s: %v, want none", v.refused)
	}
	if share < 0.9 {
		t.Errorf("%.3f of the sandbox's 25 a second, want at least 0.9", share)
	}
}

// stripeFleet runs 3 replicas of the recipe with key, 10 stripe-go clients
// each, each calling one endpoint (stripeCall) against fake v for d.
func stripeFleet(t *testing.T, v *stripeFake, key string, d time.Duration) {
	srv := v.serve()
	defer srv.Close()
	s := redistest.Real(t)
	clients := make([]*stripe.Client, 3)
	for i := range clients {
		sc, err := readmeStripe(s.Client(t), key, stripe.String(srv.URL))
		if err != nil {
			t.Fatal(err)
		}
		clients[i] = sc
	}
	ctx := context.Background()
	runEachWorker(3, 10, d, func(i, j, _ int) {
		if err := stripeCall(ctx, clients[i], j); err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
}
