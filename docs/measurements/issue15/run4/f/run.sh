#!/bin/bash
# Issue 15, fourth slice, call F, right after call E on the warm machine: the other GGUF parts and the texts.
set -u
cp .gpuB/gguf.part.ab .gpuB/gguf.part.ac .gpuB/texts.tar.xz /tmp/s/ && ls -la /tmp/s
