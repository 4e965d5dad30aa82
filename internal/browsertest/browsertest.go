// Package browsertest drives a real headless Chromium from Go tests with
// chromedp: it finds the browser (HIPQ_TEST_CHROMIUM, else chromium,
// chromium-browser, google-chrome on PATH), starts it with a fresh
// profile and no network of its own, and records every console error,
// uncaught exception, CSP violation and dialog of the pages it opens.
// Without a browser the test is skipped with a message saying how to get
// one.
package browsertest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"testing"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// Path is the browser to drive, or "" when none is installed.
func Path() string {
	if p := os.Getenv("HIPQ_TEST_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// Browser is one browser process; each Tab has its own cookies.
type Browser struct {
	t    *testing.T
	root context.Context // the first tab, which owns the browser
}

// New starts a headless browser for the test, or skips it.
func New(t *testing.T) *Browser {
	t.Helper()
	path := Path()
	if path == "" {
		t.Skip("no Chromium found (install Debian's chromium package, as .ci/run does, or set HIPQ_TEST_CHROMIUM): browser tests skipped")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox, // our machines run tests as root
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1400, 900),
	)
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancelAlloc)
	root, cancel := chromedp.NewContext(alloc)
	t.Cleanup(cancel)
	if err := chromedp.Do(root); err != nil { // starts the browser
		t.Fatalf("start %s: %v", path, err)
	}
	return &Browser{t: t, root: root}
}

// Tab is a browser window with its own cookies (an incognito context).
type Tab struct {
	Ctx context.Context

	mu     sync.Mutex
	errors []string
}

// Tab opens a window in a fresh browser context.
func (b *Browser) Tab() *Tab {
	b.t.Helper()
	ctx, cancel := chromedp.NewContext(b.root, chromedp.WithNewBrowserContext())
	b.t.Cleanup(cancel)
	tab := &Tab{Ctx: ctx}
	// The subscriptions start the browser and the tab, and buffer what
	// comes until the goroutines read it.
	messages := chromedp.Console(ctx)
	dialogs := chromedp.Events(ctx, page.JavascriptDialogOpening)
	go func() {
		for m, err := range messages {
			if err != nil {
				return
			}
			if m.Type == chromedp.ConsoleError || m.IsException() {
				tab.add(fmt.Sprintf("%s (%s:%d)", m, m.URL, m.Line+1))
			}
		}
	}()
	go func() {
		for ev, err := range dialogs {
			if err != nil {
				return
			}
			tab.add("dialog opened: " + ev.Message)
			_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: false})
		}
	}()
	return tab
}

func (t *Tab) add(s string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.errors = append(t.errors, s)
}

// Errors returns, and forgets, what went wrong in the pages so far.
func (t *Tab) Errors() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := t.errors
	t.errors = nil
	return out
}
