package api

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"

	"gopkg.in/yaml.v3"
)

// openapiYAML is the OpenAPI 3.1 document of this API (api/openapi.yaml),
// served at GET /v1/openapi.yaml and, as JSON, at GET /v1/openapi.json.
//
//go:embed openapi.yaml
var openapiYAML []byte

// openapiJSON is openapiYAML converted to JSON once, at start.
var openapiJSON = mustJSON(openapiYAML)

// mustJSON converts a YAML document to JSON. The document is part of the
// binary, so a failure is a build mistake the tests catch.
func mustJSON(doc []byte) []byte {
	var v any
	if err := yaml.Unmarshal(doc, &v); err != nil {
		panic(fmt.Sprintf("api: openapi.yaml: %v", err))
	}
	b, err := json.Marshal(jsonValue(v))
	if err != nil {
		panic(fmt.Sprintf("api: openapi.yaml as JSON: %v", err))
	}
	return b
}

// jsonValue gives the maps of a decoded YAML value string keys, as JSON
// needs (YAML allows keys such as 200 that decode as numbers).
func jsonValue(v any) any {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			x[k] = jsonValue(e)
		}
		return x
	case map[any]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[fmt.Sprint(k)] = jsonValue(e)
		}
		return out
	case []any:
		for i, e := range x {
			x[i] = jsonValue(e)
		}
		return x
	}
	return v
}

// openapi serves the document in one of its two encodings.
func openapi(contentType string, doc []byte) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Content-Type", contentType)
		_, _ = w.Write(doc)
		return nil
	}
}
