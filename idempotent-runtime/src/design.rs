#![doc = include_str!("../docs/DESIGN.md")]
