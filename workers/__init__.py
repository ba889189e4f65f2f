"""The worker roles as data: each role's consumer group, the topics it consumes, follows and
produces, how far it scales and what its options take (workers/*.toml). `agl-stream worker`
reads them, and tests hold the compose file and the Helm chart to them."""
