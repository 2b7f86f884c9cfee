"""The example client configuration that tests/test_client_config.py and
tests/test_client_config_cases.py both read: one file with every kind of setting."""

EXAMPLE = """\
# written by `gpupool login`; mode 0600
token = "gpt_default"             # default token for servers without their own
tls = false
tls_ca = "certs/ca.pem"           # relative: to the file's folder
connect_timeout = 10
probe_timeout = 2.5

[requirements]
gpu = ""
model = "H100"
min_memory = "40GiB"

[[servers]]
address = "gpu1.example.com:7070"
token = "gpt_one"

[[servers]]
address = "tls://gpu2.example.com:7071"
tls_ca = "~/ca2.pem"

[[servers]]
address = "[::1]:7072"
tls = true
"""
