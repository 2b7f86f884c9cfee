"""The web dashboard's templates and static files (installed as the package `gpupoold_web`)."""
