package throttle_test

import (
	"context"
	"fmt"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// Go submits a job and returns at once; the job's Future gives its result.
// Close waits for the jobs still queued, as a worker does on shutdown.
func ExampleGo() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "email", policies.SlidingLog{Limit: 100, Window: time.Second},
		throttle.Options{Mode: throttle.Queue, MaxQueue: 10})
	if err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	var jobs []*throttle.Future[string]
	for _, to := range []string{"ann", "bob", "cy"} {
		jobs = append(jobs, throttle.Go(ctx, lim, func(ctx context.Context) (string, error) {
			return "sent to " + to, nil // send the e-mail here
		}))
	}
	for _, job := range jobs {
		fmt.Println(job.Wait())
	}
	fmt.Println(lim.Close(ctx))
	// Output:
	// sent to ann <nil>
	// sent to bob <nil>
	// sent to cy <nil>
	// <nil>
}

// A call whose cost is known only afterwards is admitted at an estimate and
// settled at what the vendor counted: the quota gets the difference back.
func ExamplePermit_Settle() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "llm-tokens", policies.SlidingLog{Limit: 10_000, Window: time.Minute})
	if err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	p, err := lim.Acquire(ctx, throttle.Cost(4000)) // the prompt and max_tokens
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Release()
	u, _ := lim.Usage(ctx)
	fmt.Println("admitted at", u.Rules[0].Used)

	used := 1200 // as the vendor's reply says
	err = p.Settle(ctx, throttle.Cost(used))
	u, _ = lim.Usage(ctx)
	fmt.Println("settled at", u.Rules[0].Used, err)
	// Output:
	// admitted at 4000
	// settled at 1200 <nil>
}

// Usage reads how full a quota is and changes nothing, so a dashboard or a
// health check may call it as often as it likes.
func ExampleLimiter_Usage() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "github-api", policies.SlidingLog{Limit: 5000, Window: time.Hour})
	if err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	for range 3 {
		_, _ = lim.Allow(ctx)
	}
	u, err := lim.Usage(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	r := u.Rules[0]
	fmt.Printf("%s: %d used, %d remaining of %d; paused %v\n", r.Rule.Kind, r.Used, r.Remaining, r.Limit, u.Paused)
	// Output: sliding log: 3 used, 4997 remaining of 5000; paused 0s
}

// Quotas lists the quotas a Redis holds under a prefix, sorted by name: a
// tool finds them without being told, and Open reads each one.
func ExampleQuotas() {
	rdb, done := exampleRedis()
	defer done()
	ctx := context.Background()

	// Somewhere in the fleet, two quotas under the default prefix and one
	// under a prefix of its own:
	for _, name := range []string{"twilio-sms", "github-api"} {
		lim, _ := throttle.New(rdb, name, policies.SlidingLog{Limit: 100, Window: time.Second})
		_, _ = lim.Allow(ctx) // a quota is stored on its first call
	}
	staging, _ := throttle.New(rdb, "twilio-sms", policies.SlidingLog{Limit: 100, Window: time.Second},
		throttle.Options{Prefix: "staging"})
	_, _ = staging.Allow(ctx)

	// In the tool:
	for _, prefix := range []string{"", "staging"} {
		quotas, err := throttle.Quotas(ctx, rdb, prefix)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("%q: %v\n", prefix, quotas)
	}
	// Output:
	// "": [{github-api } {twilio-sms }]
	// "staging": [{twilio-sms }]
}
