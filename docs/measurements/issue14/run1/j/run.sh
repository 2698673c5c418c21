#!/bin/bash
# Issue 14, first slice, call J: build D's binaries (the agreement test as landed:
# pairs of sets, then every set against the float model) and the first GGUF part, left in /tmp for call K.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/ && ls -la /tmp/x /tmp/s
