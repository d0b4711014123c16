package vendors

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// tries counts the requests an SDK sends through its transport.
type tries struct {
	n    atomic.Int64
	next http.RoundTripper
}

func (t *tries) RoundTrip(req *http.Request) (*http.Response, error) {
	t.n.Add(1)
	return t.next.RoundTrip(req)
}

// refusingTransport returns a Transport over a quota of one call a
// minute, its one call taken, that refuses every request at once.
func refusingTransport(t *testing.T, name string) *tries {
	t.Helper()
	lim, err := throttle.New(redistest.Mini(t).Client(t), name,
		policies.SlidingLog{Limit: 1, Window: time.Minute}, throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lim.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &tries{next: &throttle.Transport{Limiter: lim}}
}

// openai-go and anthropic-sdk-go take the Transport's ErrLimited for a
// failed connection and send the request twice more, each refused again;
// option.WithMaxRetries(0) stops them, as docs/VENDORS.md says.
func TestSDKs_RetryARefusalUnlessTheirRetriesAreOff(t *testing.T) {
	for _, c := range []struct {
		name    string
		retries bool
		want    int64
	}{
		{"retries-on", true, 3},
		{"retries-off", false, 1},
	} {
		t.Run("openai-go/"+c.name, func(t *testing.T) {
			tr := refusingTransport(t, "openai-retries")
			opts := []option.RequestOption{option.WithAPIKey("sk-test"), option.WithBaseURL("http://127.0.0.1:1/"),
				option.WithHTTPClient(&http.Client{Transport: tr})}
			if !c.retries {
				opts = append(opts, option.WithMaxRetries(0))
			}
			client := openai.NewClient(opts...)
			_, err := client.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
				Model: "gpt-4o", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
				MaxCompletionTokens: openai.Int(10),
			})
			if !errors.Is(err, throttle.ErrLimited) {
				t.Fatalf("err = %v, want ErrLimited", err)
			}
			if got := tr.n.Load(); got != c.want {
				t.Errorf("the SDK sent %d tries, want %d", got, c.want)
			}
		})
		t.Run("anthropic-sdk-go/"+c.name, func(t *testing.T) {
			tr := refusingTransport(t, "anthropic-retries")
			opts := []aoption.RequestOption{aoption.WithAPIKey("sk-ant-test"), aoption.WithBaseURL("http://127.0.0.1:1/"),
				aoption.WithHTTPClient(&http.Client{Transport: tr})}
			if !c.retries {
				opts = append(opts, aoption.WithMaxRetries(0))
			}
			client := anthropic.NewClient(opts...)
			_, err := client.Messages.New(context.Background(), anthropic.MessageNewParams{
				Model: "claude-sonnet-4-5", MaxTokens: 10,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hi"))},
			})
			if !errors.Is(err, throttle.ErrLimited) {
				t.Fatalf("err = %v, want ErrLimited", err)
			}
			if got := tr.n.Load(); got != c.want {
				t.Errorf("the SDK sent %d tries, want %d", got, c.want)
			}
		})
	}
}
