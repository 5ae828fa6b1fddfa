//go:build tools

package tools

import _ "github.com/NVIDIA/aistore/cmd/aisnode"
