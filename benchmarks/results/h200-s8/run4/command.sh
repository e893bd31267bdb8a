export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache KALOS_RUNTIME_DIR=/tmp/krt; mkdir -p -m 700 /tmp/krt
timeout 380 python3 -m pytest -q -p no:cacheprovider tests/test_torch_engine.py -k "int8 or (cuda and fast)" 2>&1 | tail -8
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_slot_server.py -m cuda -k "fast" 2>&1 | tail -5
