// Package vendors proves the transport with the vendors' own clients: the
// official github.com/google/go-github, github.com/openai/openai-go,
// github.com/anthropics/anthropic-sdk-go and github.com/stripe/stripe-go,
// against local fakes that count and answer as each vendor documents
// (docs/VENDORS.md has the sources), and runs the recipes of
// docs/VENDORS.md. It is a module of its own, so that the library's go.mod
// stays lean. Each vendor's fleet runs 6 to 9 s by default, 20 s with
// THROTTLE_LONG=1.
package vendors
