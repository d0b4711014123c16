package graphql

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle"
)

// The answers as Shopify and GitHub document them, and a few they might
// send: a cost read only where the vendor states it.
func TestReaders_ReadTheDocumentedFields(t *testing.T) {
	tests := []struct {
		name      string
		read      func([]byte, *throttle.Answer) int
		body      string
		cost      int
		remaining int // of Answer.Tokens, -1 for none
		status    int
		retry     time.Duration
	}{
		{"Shopify, a query run", Shopify, `{"data":{},"extensions":{"cost":{"requestedQueryCost":101,"actualQueryCost":46,` +
			`"throttleStatus":{"maximumAvailable":1000.0,"currentlyAvailable":954,"restoreRate":50.0}}}}`, 46, 954, 200, 0},
		{"Shopify, throttled", Shopify, `{"errors":[{"message":"Throttled","extensions":{"code":"THROTTLED",` +
			`"documentation":"https://shopify.dev/api/usage/rate-limits"}}],"extensions":{"cost":{"requestedQueryCost":202,` +
			`"actualQueryCost":null,"throttleStatus":{"maximumAvailable":1000.0,"currentlyAvailable":2,"restoreRate":50.0}}}}`,
			-1, 2, http.StatusTooManyRequests, 4 * time.Second},
		{"Shopify, no cost", Shopify, `{"data":{}}`, -1, -1, 200, 0},
		{"Shopify, not JSON", Shopify, `<html>`, -1, -1, 200, 0},
		{"GitHub, cost asked", GitHub, `{"data":{"viewer":{"login":"octocat"},"rateLimit":{"cost":3,"remaining":4990,"resetAt":"2026-01-01T00:00:00Z"}}}`,
			3, -1, 200, 0},
		{"GitHub, cost not asked", GitHub, `{"data":{"viewer":{"login":"octocat"}}}`, -1, -1, 200, 0},
		{"GitHub, the headers' count of points", GitHub, `{"data":{}}`, -1, 4990, 200, 0},
		{"GitHub, rate limited", GitHub, `{"errors":[{"type":"RATE_LIMITED","message":"API rate limit exceeded for user ID 1."}]}`,
			-1, -1, http.StatusTooManyRequests, 0},
	}
	for _, tt := range tests {
		a := throttle.Answer{Status: 200}
		if strings.Contains(tt.name, "headers") {
			a.Requests = &throttle.Count{Remaining: 4990, Limit: 5000}
		}
		cost := tt.read([]byte(tt.body), &a)
		remaining := -1
		if a.Tokens != nil {
			remaining = a.Tokens.Remaining
		}
		if cost != tt.cost || remaining != tt.remaining || a.Status != tt.status || a.RetryAfter != tt.retry ||
			a.AboutRate != (tt.status == http.StatusTooManyRequests) {
			t.Errorf("%s: cost %d, remaining %d, %+v; want cost %d, remaining %d, status %d, RetryAfter %v",
				tt.name, cost, remaining, a, tt.cost, tt.remaining, tt.status, tt.retry)
		}
	}
}

// A document's operations, as GraphQL writes them: a mutation is found by
// the first word of a definition, wherever the word appears elsewhere.
func TestMutation_ReadsTheFirstWordOfEachDefinition(t *testing.T) {
	tests := []struct {
		doc  string
		want bool
	}{
		{`mutation { addStar(input: {starrableId: "1"}) { clientMutationId } }`, true},
		{`  mutation AddStar($id: ID!) { addStar(input: {starrableId: $id}) { clientMutationId } }`, true},
		{`query { viewer { login } }`, false},
		{`{ viewer { login } }`, false},
		{`query($mutation: String = "mutation") { search(query: $mutation) { mutation } }`, false},
		{"# mutation { addStar }\nquery { viewer { login } }", false},
		{`query { a(s: """ } mutation { """) { b } }`, false},
		{`query { a(s: "\" } mutation {") { b } }`, false},
		{`fragment f on Mutation { addStar { clientMutationId } } query { viewer { ...f } }`, false},
		{`query Q { viewer { login } } mutation M { addStar(input: {}) { clientMutationId } }`, true},
		{`subscription { issueCreated { id } }`, false},
		{``, false},
		{`}}} mutation {`, true},
	}
	for _, tt := range tests {
		if got := Mutation(tt.doc); got != tt.want {
			t.Errorf("Mutation(%q) = %v, want %v", tt.doc, got, tt.want)
		}
	}
}
