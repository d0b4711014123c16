package throttle

import (
	"bytes"
	"io"
	"net/http"
	"strings"
)

// maxAnswerBody bounds the body a Route's FromBody reads: a GraphQL
// answer that states its cost is most often far shorter.
const maxAnswerBody = 1 << 20

// routeOf returns the route of r, which match matches.
func routeOf(r Route, match func(*http.Request) bool) route {
	return route{match: match, lim: r.Limiter, resource: strings.ToLower(strings.TrimSpace(r.Resource)), fromBody: r.FromBody}
}

// readBody makes a the answer the route takes from resp, and returns the
// call's cost the body states, or -1. An answer about another resource
// than the route's tells its quota nothing. FromBody reads the body, which
// resp then reads the same as the vendor's.
func (rt route) readBody(resp *http.Response, a *Answer, v vendorLimits) int {
	if rt.resource != "" && v.resource != "" && v.resource != rt.resource {
		// GitHub counts each resource apart: another's counts are not ours.
		*a = Answer{DefaultPause: a.DefaultPause}
		return -1
	}
	if rt.fromBody == nil {
		return -1
	}
	body, ok := peekBody(resp, maxAnswerBody)
	if !ok {
		return -1
	}
	return rt.fromBody(body, a)
}

// peekBody reads up to n bytes of the body of resp, and gives resp a body
// that reads the same as the vendor's: what was read, then the rest, or
// the error of the read. It reports false when the body was longer than n
// or could not be read whole.
func peekBody(resp *http.Response, n int64) ([]byte, bool) {
	if resp.Body == nil || resp.Body == http.NoBody {
		return nil, true
	}
	buf, err := io.ReadAll(io.LimitReader(resp.Body, n+1))
	rest := io.Reader(resp.Body)
	if err != nil {
		rest = errReader{err}
	}
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(buf), rest), resp.Body}
	// A body cut short says nothing for certain.
	return buf, err == nil && int64(len(buf)) <= n
}
