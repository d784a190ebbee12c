// cdi-check feeds CDI spec files to the CDI reference library
// (tags.cncf.io/container-device-interface), injects the named devices into a sample OCI
// runtime spec and prints the result as JSON, so Python tests can prove that the files the
// node agent writes are usable by a real consumer (the same code CRI-O and containerd run).
//
// Usage: cdi-check --spec-dir DIR [--spec-dir DIR2] --device vendor/class=name [--device ...]
//
// Output (stdout, one JSON object): {"spec": <OCI spec after injection>, "errors": {file: [..]}}.
// Exit status 1 when a device cannot be resolved, a spec file is invalid, or injection fails.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(v string) error { *m = append(*m, v); return nil }

func sampleSpec() *oci.Spec {
	return &oci.Spec{
		Version: oci.Version,
		Process: &oci.Process{
			Args: []string{"/bin/sh"},
			Env:  []string{"PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=void"},
			Cwd:  "/",
		},
		Root:   &oci.Root{Path: "rootfs"},
		Linux:  &oci.Linux{},
		Mounts: []oci.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}},
	}
}

func main() {
	var dirs, devices multi
	flag.Var(&dirs, "spec-dir", "CDI spec directory (repeatable)")
	flag.Var(&devices, "device", "fully-qualified CDI device to inject (repeatable)")
	flag.Parse()
	if len(dirs) == 0 || len(devices) == 0 {
		fmt.Fprintln(os.Stderr, "usage: cdi-check --spec-dir DIR --device vendor/class=name ...")
		os.Exit(2)
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		fail("cache: %v", err)
	}
	specErrors := map[string][]string{}
	for path, errs := range cache.GetErrors() {
		for _, e := range errs {
			specErrors[path] = append(specErrors[path], e.Error())
		}
	}
	spec := sampleSpec()
	unresolved, injectErr := cache.InjectDevices(spec, devices...)
	out := map[string]any{"spec": spec, "errors": specErrors, "unresolved": unresolved}
	if injectErr != nil {
		out["injectError"] = injectErr.Error()
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(out); err != nil {
		fail("encode: %v", err)
	}
	if injectErr != nil || len(specErrors) > 0 {
		os.Exit(1)
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "cdi-check: "+format+"\n", args...)
	os.Exit(1)
}
