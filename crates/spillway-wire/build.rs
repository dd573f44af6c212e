//! Writes OpenAI's o200k_base vocabulary to `OUT_DIR/o200k.bin` for `src/tokens.rs`.
//!
//! tiktoken-rs is only a build dependency: its runtime encoder keeps every token's bytes
//! three times over in hash maps (~46 MiB resident), several times the gateway's whole
//! idle budget. Here it is just the source of truth for the vocabulary, written out once
//! in a form the gateway can index in ~3 MiB.
//!
//! Format: for each rank from 0 in order, one length byte (1..=255) then the token's bytes.
//! A token's rank is its position, so no rank is stored.

use std::collections::HashSet;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let bpe = tiktoken_rs::o200k_base().expect("tiktoken-rs ships o200k_base");
    // Special tokens (`<|endoftext|>`, `<|endofprompt|>`) sit just past the ordinary ranks;
    // they never come out of ordinary encoding, so they must not go into the table.
    let special: HashSet<tiktoken_rs::Rank> = bpe
        .special_tokens()
        .into_iter()
        .flat_map(|s| bpe.encode_with_special_tokens(s))
        .collect();
    let mut out = Vec::with_capacity(2 << 20);
    let mut count: u32 = 0;
    // Ordinary ranks are contiguous from 0: the first gap (or special token) is the end.
    while !special.contains(&count) {
        let Ok(token) = bpe.decode_bytes(&[count]) else { break };
        let len = u8::try_from(token.len()).expect("every o200k token is at most 255 bytes");
        assert!(len > 0, "rank {count} decodes to no bytes");
        out.push(len);
        out.extend_from_slice(&token);
        count += 1;
    }
    // A broken or changed vocabulary must fail the build, not ship a tiny table whose
    // counts would be silently wrong.
    assert!(count > 190_000, "o200k_base yielded only {count} ordinary tokens");
    let dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(dir.join("o200k.bin"), out).expect("write o200k.bin");
}
