"""The one compiled part: the projector's SpanRecorded reader (agl_stream/projection/_spanfast.c).

Optional: where no C compiler is found the install goes on without it and the projector reads
spans through fastavro (slower, same rows). Everything else is configured in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "agl_stream.projection._spanfast",
            ["agl_stream/projection/_spanfast.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
)
