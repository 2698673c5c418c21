#!/bin/bash
# The full conformance suite on the landed build.
sfx test-backend --device cuda > $OUT/test_backend_cuda.md 2>&1
