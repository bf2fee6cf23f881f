package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

const root = "../.."

// mdLink is an inline markdown link's target: [text](target).
var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

func TestRelativeLinksResolve(t *testing.T) {
	pages := append([]string{"README.md"}, globDocs(t)...)
	checked := 0
	for _, page := range pages {
		for _, target := range links(t, page) {
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			checked++
			if err := resolve(page, target); err != "" {
				t.Errorf("%s: link %q: %s", page, target, err)
			}
		}
	}
	if checked < 20 {
		t.Errorf("only %d relative links found: is the link pattern still right?", checked)
	}
}

// TestEveryPageIsReachableFromTheREADME: a page nobody links to is lost.
func TestEveryPageIsReachableFromTheREADME(t *testing.T) {
	linked := map[string]bool{}
	for _, target := range links(t, "README.md") {
		file, _, _ := strings.Cut(target, "#")
		linked[filepath.Clean(file)] = true
	}
	for _, page := range globDocs(t) {
		if !linked[page] {
			t.Errorf("README.md does not link to %s", page)
		}
	}
}

// TestResolveRefusesWhatIsMissing keeps the checker honest.
func TestResolveRefusesWhatIsMissing(t *testing.T) {
	for _, target := range []string{"docs/no-such-page.md", "docs/testing.md#no-such-heading", "#no-such-heading"} {
		if resolve("README.md", target) == "" {
			t.Errorf("%q resolved", target)
		}
	}
	if err := resolve("README.md", "docs/testing.md#ci"); err != "" {
		t.Errorf("docs/testing.md#ci: %s", err)
	}
}

func globDocs(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil || len(pages) == 0 {
		t.Fatalf("no docs/*.md: %v", err)
	}
	for i, p := range pages {
		pages[i], _ = filepath.Rel(root, p)
	}
	return pages
}

func links(t *testing.T, page string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, page))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range mdLink.FindAllStringSubmatch(stripCode(string(b)), -1) {
		out = append(out, m[1])
	}
	return out
}

// resolve says what is wrong with target, a link in page, or "".
func resolve(page, target string) string {
	file, frag, _ := strings.Cut(target, "#")
	path := filepath.Join(root, page)
	if file != "" {
		path = filepath.Join(root, filepath.Dir(page), file)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		if info, serr := os.Stat(path); serr == nil && info.IsDir() && frag == "" {
			return ""
		}
		return "no such file"
	}
	if frag == "" || !strings.HasSuffix(path, ".md") {
		return ""
	}
	if !anchors(string(b))[frag] {
		return "no heading with that anchor in " + filepath.Base(path)
	}
	return ""
}

// anchors are the fragment names GitHub gives a page's headings.
func anchors(md string) map[string]bool {
	seen := map[string]int{}
	out := map[string]bool{}
	for _, line := range strings.Split(stripCode(md), "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(line, "#"))
		slug := slugify(text)
		if n := seen[slug]; n > 0 {
			out[slug+"-"+strconv.Itoa(n)] = true
		} else {
			out[slug] = true
		}
		seen[slug]++
	}
	return out
}

func slugify(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// stripCode blanks fenced code blocks, whose lines are neither headings nor
// links.
func stripCode(md string) string {
	lines := strings.Split(md, "\n")
	in := false
	for i, l := range lines {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			in = !in
			lines[i] = ""
			continue
		}
		if in {
			lines[i] = ""
		}
	}
	return strings.Join(lines, "\n")
}
