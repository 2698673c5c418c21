#!/bin/bash
# Issue 14, first slice, call H: build D's binaries (the agreement test now takes
# SFX_AGREEMENT_K) and the first GGUF part, left in /tmp for call I.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/ && ls -la /tmp/x /tmp/s
