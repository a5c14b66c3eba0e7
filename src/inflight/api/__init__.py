"""The Tinker-compatible service: wire schemas (`schemas`), ids (`ids`), the database (`db`) and the durable
futures queue (`futures`) between thin routes and the engine loop that batches and executes requests.
"""
