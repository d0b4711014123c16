package throttle_test

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// Every link of the README to a part of docs/VENDORS.md reaches one of
// its headings, by the anchor GitHub makes of it, and every vendor's
// recipe has a line.
func TestREADME_VendorLinksReachTheirRecipes(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	vendors, err := os.ReadFile("docs/VENDORS.md")
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	punct := regexp.MustCompile(`[^a-z0-9 _-]`)
	for _, line := range strings.Split(string(vendors), "\n") {
		if h, ok := strings.CutPrefix(line, "### "); ok {
			anchors[strings.ReplaceAll(punct.ReplaceAllString(strings.ToLower(h), ""), " ", "-")] = true
		}
	}
	linked := map[string]bool{}
	for _, m := range regexp.MustCompile(`\(docs/VENDORS\.md#([^)]+)\)`).FindAllStringSubmatch(string(readme), -1) {
		linked[m[1]] = true
		if !anchors[m[1]] {
			t.Errorf("the README links to docs/VENDORS.md#%s, which no heading makes", m[1])
		}
	}
	for _, vendor := range []string{"github", "shopify", "stripe", "openai", "anthropic", "twilio"} {
		if !linked[vendor] {
			t.Errorf("the README has no line linking to %s's recipe", vendor)
		}
	}
}
