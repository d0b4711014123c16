// Package graphql reads what GraphQL vendors state of a call's cost in
// the body of their answers, for a throttle.Route's FromBody: the fleet
// admits each call at its estimate, and settles it to the cost the vendor
// counted.
//
//	throttle.Route{Pattern: "/admin/api/", Limiter: lim, FromBody: graphql.Shopify}
//	throttle.Route{Pattern: "api.github.com/graphql", Limiter: lim, Resource: "graphql", FromBody: graphql.GitHub}
package graphql

import (
	"encoding/json"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/throttlekit/throttle"
)

// Shopify reads an answer of Shopify's GraphQL Admin API. Its
// extensions.cost holds the query's actualQueryCost, which Shopify charged
// after running it, and the app's bucket (throttleStatus), which becomes
// the Answer's count of units: currentlyAvailable.
// A THROTTLED error, which Shopify sends with a status of 200, is a
// refusal about the rate: the fleet waits until the bucket has restored
// the query's requestedQueryCost, at restoreRate points a second.
// It returns -1 for an answer that states no actual cost.
func Shopify(body []byte, a *throttle.Answer) int {
	var b struct {
		Errors []struct {
			Extensions struct{ Code string }
		}
		Extensions struct {
			Cost struct {
				RequestedQueryCost int
				ActualQueryCost    *int
				ThrottleStatus     *struct {
					MaximumAvailable, CurrentlyAvailable, RestoreRate float64
				}
			}
		}
	}
	if json.Unmarshal(body, &b) != nil {
		return -1
	}
	c := b.Extensions.Cost
	if s := c.ThrottleStatus; s != nil && s.CurrentlyAvailable >= 0 {
		// A bucket restores all the time: no reset to wait for.
		a.Tokens = &throttle.Count{Remaining: int(s.CurrentlyAvailable)}
		for _, e := range b.Errors {
			if e.Extensions.Code == "THROTTLED" {
				a.Status, a.AboutRate, a.HasRetryAfter = http.StatusTooManyRequests, true, true
				a.RetryAfter = restore(float64(c.RequestedQueryCost)-s.CurrentlyAvailable, s.RestoreRate)
			}
		}
	}
	if c.ActualQueryCost == nil || *c.ActualQueryCost < 0 {
		return -1
	}
	return *c.ActualQueryCost
}

// restore returns how long a bucket restoring rate points a second takes
// to restore points, rounded up to the millisecond.
func restore(points, rate float64) time.Duration {
	if points <= 0 || rate <= 0 {
		return 0
	}
	return time.Duration(math.Ceil(points/rate*1000)) * time.Millisecond
}

// GitHub reads an answer of GitHub's GraphQL API: the query's cost in
// points, data.rateLimit.cost, when the query asks for rateLimit { cost }.
// GitHub's x-ratelimit-* headers count points on GraphQL, not requests:
// their count becomes the Answer's Tokens, which the rules of the units
// the calls cost follow. An error of type RATE_LIMITED is a refusal about
// the rate. It returns -1 for an answer that states no cost.
func GitHub(body []byte, a *throttle.Answer) int {
	if a.Requests != nil && a.Tokens == nil {
		a.Tokens, a.Requests = a.Requests, nil
	}
	var b struct {
		Data struct {
			RateLimit *struct{ Cost *int }
		}
		Errors []struct{ Type string }
	}
	if json.Unmarshal(body, &b) != nil {
		return -1
	}
	for _, e := range b.Errors {
		if e.Type == "RATE_LIMITED" {
			if a.Status < 400 {
				a.Status = http.StatusTooManyRequests
			}
			a.AboutRate = true
		}
	}
	if b.Data.RateLimit == nil || b.Data.RateLimit.Cost == nil || *b.Data.RateLimit.Cost < 0 {
		return -1
	}
	return *b.Data.RateLimit.Cost
}

// Mutation reports whether a GraphQL document defines a mutation, for a
// vendor that counts a mutation apart: GitHub's secondary limit takes 5
// points of a minute's 2,000 for a request with a mutation, 1 for a query.
// It reads the first word of each of the document's definitions, past
// comments and strings; a word elsewhere (a field, an argument, a
// fragment's type) is not an operation.
func Mutation(document string) bool {
	start, depth := true, 0
	for i := 0; i < len(document); {
		c := document[i]
		switch {
		case c == '#':
			for i < len(document) && document[i] != '\n' && document[i] != '\r' {
				i++
			}
			continue
		case c == '"':
			i = skipString(document, i)
			continue
		case c == '$':
			i = skipName(document, i+1) // a variable, whatever its name
			continue
		case isNameStart(c):
			end := skipName(document, i)
			if start && depth == 0 {
				if document[i:end] == "mutation" {
					return true
				}
				start = false
			}
			i = end
			continue
		case c == '{':
			start = false
			depth++
		case c == '}':
			if depth--; depth <= 0 {
				start, depth = true, 0
			}
		}
		i++
	}
	return false
}

// skipName returns the index past the name that begins at i.
func skipName(s string, i int) int {
	for i < len(s) && (isNameStart(s[i]) || s[i] >= '0' && s[i] <= '9') {
		i++
	}
	return i
}

func isNameStart(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

// skipString returns the index past the string, or the block string,
// that begins at i.
func skipString(s string, i int) int {
	if strings.HasPrefix(s[i:], `"""`) {
		for j := i + 3; j < len(s); j++ {
			if s[j] == '\\' && strings.HasPrefix(s[j:], `\"""`) {
				j += 3
			} else if strings.HasPrefix(s[j:], `"""`) {
				return j + 3
			}
		}
		return len(s)
	}
	for j := i + 1; j < len(s); j++ {
		switch s[j] {
		case '\\':
			j++
		case '"', '\n':
			return j + 1
		}
	}
	return len(s)
}
