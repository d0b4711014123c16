package throttle

import (
	"reflect"
	"testing"
	"time"
)

// The replies are decoded by position, as the scripts' headers document
// them: each field is checked against a value no other field has.
func TestDecodeAcquire_NamesEveryField(t *testing.T) {
	v := []int64{
		1_000, 2_000, 3, 1, 5_000, 6_000, 8, 1_500, 2, // the header
		1, 9_000, 10, int64(reasonNone), 0, 0, 5, 4, 13, // the first call: booked, noted by rules 1 and 3, logged by 3
		0, 11_000, 0, int64(reasonBusy), 3, 12_000, 0, 0, 0, // the second: refused by a rule blind since a new policy, its key paused
	}
	got, err := decodeAcquire(v, 2)
	if err != nil {
		t.Fatal(err)
	}
	us := time.Microsecond
	want := acquireReply{
		now: 1_000 * us, pause: 2_000 * us, epoch: 3, lost: true, margin: 5_000 * us,
		done: 6_000 * us, seq: 8, paused: 1_500 * us, pausedBy: PausedByLoss,
		calls: []callReply{
			{admitted: true, wait: 9_000 * us, remaining: 10, reason: reasonNone, noted: 5, logged: 4, room: 13},
			{admitted: false, wait: 11_000 * us, remaining: 0, reason: reasonBusy, blindBy: PausedByPolicy, pause: 12_000 * us},
		},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("decodeAcquire = %+v, want %+v", got, want)
	}
	if got, err := decodeAcquire([]int64{0, 0, 0, 0, 0, 0, 0, 0, 0}, 0); err != nil || len(got.calls) != 0 || got.lost {
		t.Errorf("decodeAcquire of a header alone = %+v, %v", got, err)
	}
	if _, err := decodeAcquire(v, 3); err == nil {
		t.Error("decodeAcquire of 2 calls' reply as 3 calls: no error")
	}
}

func TestDecodeFeedback_NamesEveryField(t *testing.T) {
	got, err := decodeFeedback([]int64{3_000, 1_000, 2, 1, 40, 7, 1, 1})
	if err != nil {
		t.Fatal(err)
	}
	want := feedbackReply{until: 1_000 * time.Microsecond, charged: 2, now: 3_000 * time.Microsecond, lowered: true, limit: 40, others: 7, measuring: true, dropped: true}
	if got != want {
		t.Errorf("decodeFeedback = %+v, want %+v", got, want)
	}
	if _, err := decodeFeedback([]int64{1, 2, 3}); err == nil {
		t.Error("decodeFeedback of 3 values: no error")
	}
}
