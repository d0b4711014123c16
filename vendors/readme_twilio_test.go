package vendors

import (
	"net/http"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// The Twilio recipe of docs/VENDORS.md, compiled and run here.
func readmeTwilio(rdb *redis.Client) (*http.Client, error) {
	// README twilio
	// Twilio limits the account's requests in flight: 100 is the figure usually reported.
	lim, err := throttle.New(rdb, "twilio", policies.Concurrency{Max: 100})
	if err != nil {
		return nil, err
	}
	client := &http.Client{Transport: &throttle.Transport{Limiter: lim,
		RetryAnyMethod: true, // a 20429 was never processed: a POST is safe to send again
	}}
	// README end
	return client, nil
}
