package vendors

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// twilioSend posts a message through client.
func twilioSend(ctx context.Context, client *http.Client, baseURL string) error {
	form := url.Values{"To": {"+15550100"}, "From": {"+15550199"}, "Body": {"hello"}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/2010-04-01/Accounts/AC1/Messages.json", strings.NewReader(form.Encode()))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("Twilio: %s", resp.Status)
	}
	return nil
}

// The Twilio recipe against the fake: a message refused with a 20429 is
// sent again, once, and processed once.
func TestREADME_TwilioRecipeRuns(t *testing.T) {
	v := newTwilioFake(100, 0)
	v.refuse = 1
	srv := v.serve()
	defer srv.Close()
	s := redistest.Mini(t)
	client, err := readmeTwilio(s.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := twilioSend(context.Background(), client, srv.URL); err != nil {
		t.Fatal(err)
	}
	_, early, _, processed := v.results()
	if early != 1 || len(processed) == 0 || processed[0] != 1 || time.Since(start) >= time.Second {
		t.Errorf("%d refused, processed %v in %v; want 1 refused, then 1 processed, with no pause of the fleet", early, processed, time.Since(start))
	}
}

// A fleet of 3 × 10 through the recipe, against a fake that processes
// 12 requests in flight, 100 ms each, and refuses a 13th with a 20429:
// after the first second no refusal, and the messages processed at 0.9
// or more of what 12 in flight allow (120 a second).
func TestTwilio_FleetKeepsTheAccountsRequestsInFlight(t *testing.T) {
	const inFlight, latency = 12, 100 * time.Millisecond
	d := fleetRun(6*time.Second, 20*time.Second)
	v := newTwilioFake(inFlight, latency)
	srv := v.serve()
	defer srv.Close()
	s := redistest.Real(t)
	clients := make([]*http.Client, 3)
	for i := range clients {
		lim, err := throttle.New(s.Client(t), "twilio-fleet", policies.Concurrency{Max: inFlight})
		if err != nil {
			t.Fatal(err)
		}
		clients[i] = &http.Client{Transport: &throttle.Transport{Base: &http.Transport{MaxIdleConnsPerHost: 16}, Limiter: lim, RetryAnyMethod: true}}
	}
	ctx := context.Background()
	runEach(3, 10, d, func(i int) {
		if err := twilioSend(ctx, clients[i], srv.URL); err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
	refused, early, most, processed := v.results()
	seconds := int(d / time.Second)
	sum := 0
	for _, n := range processed[1:min(seconds, len(processed))] {
		sum += n
	}
	got := float64(sum) / (float64(seconds-1) * float64(inFlight) * float64(time.Second/latency))
	t.Logf("Twilio: %d refused in the first second, %d after it; most in flight %d of %d; processed a second %v; %.3f of what %d in flight allow",
		early, refused, most, inFlight, processed, got, inFlight)
	if refused != 0 {
		t.Errorf("%d refusals after the first second, want none", refused)
	}
	if got < 0.9 {
		t.Errorf("%.3f of what the requests in flight allow, want at least 0.9", got)
	}
}
