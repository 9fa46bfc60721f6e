"""Who belongs to a job: the job secret, admission of members, and where listeners may listen."""

from lowband.trust.admission import (
    Address,
    AdmissionRefused,
    BindRefused,
    Claim,
    RemovedFromJob,
    admit,
    check_bind,
    claim_of,
    is_public,
    job_address,
    member_of,
    replica_id,
    screen,
)
from lowband.trust.secret import SecretError, load_secret, new_secret, tag, verify, write_secret

__all__ = ["SecretError", "load_secret", "new_secret", "tag", "verify", "write_secret", "Address", "AdmissionRefused", "BindRefused", "Claim", "RemovedFromJob", "admit", "check_bind", "claim_of", "is_public", "job_address", "member_of", "replica_id", "screen"]
