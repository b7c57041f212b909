"""Requests and the journal: the front door (door), the one record of a request (job), the request scheduler, the journal and its standby copy, outline requests, the model's text side."""
