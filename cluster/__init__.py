"""The cluster layer of pgq (installed as ``pgq.cluster``).

Home of the node process, the authenticated cluster bus, gossip membership and
the inter-node job protocol (replication to W node databases, ACK/DELJOB,
re-queue coordination, federation, leaving). It is built in the cluster issue;
until then pgq runs as a single node and this package holds no code.
"""
