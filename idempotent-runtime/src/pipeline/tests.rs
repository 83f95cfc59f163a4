//! Each step of the pipeline, driven by a test adapter without any framework.
