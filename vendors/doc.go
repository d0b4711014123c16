// Package vendors proves the transport with the vendors' own clients: the
// official github.com/google/go-github and github.com/openai/openai-go,
// with their own retries left on, against local fakes that speak the
// vendors' rate-limit headers. It is a module of its own, so that the
// library's go.mod stays lean.
package vendors
