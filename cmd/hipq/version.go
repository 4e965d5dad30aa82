package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// version is set at build time (-ldflags "-X main.version=v1.2.3"); else
// the module's version from the build info.
var version = ""

// versionText is what `hipq version` prints: the version, then the build's
// commit, its time and whether the tree was modified, and the Go version.
func versionText() string {
	v, commit, when, dirty := version, "", "", ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v == "" {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				commit = s.Value
			case "vcs.time":
				when = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					dirty = " (modified)"
				}
			}
		}
	}
	if v == "" {
		v = "(devel)"
	}
	out := "hipq " + v + "\n"
	if commit != "" {
		out += fmt.Sprintf("commit: %s%s\n", commit, dirty)
	}
	if when != "" {
		out += "built from a commit of: " + when + "\n"
	}
	return out + fmt.Sprintf("go: %s %s/%s\n", runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

func cmdVersion(stdout io.Writer) { fmt.Fprint(stdout, versionText()) }
