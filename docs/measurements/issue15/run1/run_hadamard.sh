#!/bin/bash
# The code frame's rotation on the H200, beside the KVarN attention op (one short call).
mkdir -p /tmp/kv3 && xz -dc .gpu/xz/kv3.xz > /tmp/kv3/sfx && chmod +x /tmp/kv3/sfx
timeout 60 /tmp/kv3/sfx test-backend --device cuda --op hadamard_rows --op kvarn_attention > $OUT/test_backend_hadamard.md 2>&1
