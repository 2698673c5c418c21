#!/bin/bash
# Issue 14, first slice, call N: sfx-run and sfx-convert of commit c12dcaa and the first GGUF
# part, left in /tmp for call O.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/ && ls /tmp/x
