use std::cell::Cell;
use std::path::PathBuf;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::*;

fn fixture() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mixtral");
    Tokenizer::from_dir(&dir).unwrap().unwrap()
}

/// A SentencePiece-style tokenizer (Mistral's decoder: `▁` → space, byte fallback, fuse, strip
/// one leading space) over a word-level vocabulary.
fn sentencepiece() -> (tempfile::TempDir, Tokenizer) {
    let json = r#"{
      "version": "1.0", "truncation": null, "padding": null,
      "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": true}],
      "normalizer": null, "pre_tokenizer": null, "post_processor": null,
      "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
      "model": {"type": "WordLevel", "unk_token": "<s>", "vocab": {"<s>": 0, "▁Hello": 1,
        "▁world": 2, "<0xE2>": 3, "<0x82>": 4, "<0xAC>": 5, ",": 6, "▁": 7}}
    }"#;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    let tok = Tokenizer::from_file(&path).unwrap();
    (dir, tok)
}

/// Every delta of `ids` pushed one by one, and the flush.
fn stream(tok: &Tokenizer, prompt: &[u32], ids: &[u32]) -> (Vec<String>, String) {
    let mut d = IncrementalDecoder::new(prompt);
    let deltas = ids.iter().map(|&id| d.push(tok, id).unwrap()).collect();
    let tail = d.flush(tok).unwrap();
    assert_eq!(d.num_generated(), ids.len());
    (deltas, tail)
}

#[test]
fn sentencepiece_text_matches_decode_of_the_generated_ids() {
    let (_dir, tok) = sentencepiece();
    // `decode` strips the first token's leading space; a skipped special token in the middle
    // must not make the next word lose its space.
    let ids = [1, 0, 2, 6, 7, 1];
    assert_eq!(tok.decode(&ids).unwrap(), "Hello world,  Hello");
    let (deltas, tail) = stream(&tok, &[], &ids);
    assert_eq!(deltas, ["Hello", "", " world", ",", " ", " Hello"]);
    assert_eq!(tail, "");
    // A byte-fallback character split over three tokens comes out whole with its last byte.
    let (deltas, _) = stream(&tok, &[], &[1, 3, 4, 5]);
    assert_eq!(deltas, ["Hello", "", "", "€"]);
    // Cut short, the held bytes come out as they decode.
    let (deltas, tail) = stream(&tok, &[], &[1, 3, 4]);
    assert_eq!(
        (deltas.concat(), tail),
        ("Hello".into(), tok.decode(&[3, 4]).unwrap())
    );
}

#[test]
fn a_prompt_as_context_keeps_the_first_tokens_space() {
    let (_dir, tok) = sentencepiece();
    // After a prompt ending in a word, the first generated word reads " world" (vLLM's text),
    // where decode(generated) strips it.
    let (deltas, _) = stream(&tok, &[0, 1], &[2, 6]);
    assert_eq!(deltas, [" world", ","]);
    assert_eq!(tok.decode(&[2, 6]).unwrap(), "world,");
    // After a BOS alone there is nothing to continue: the same as decode(generated).
    let (deltas, _) = stream(&tok, &[0], &[2, 6]);
    assert_eq!(deltas.concat(), "world,");
    // Only the last few prompt ids are decoded.
    let long: Vec<u32> = std::iter::repeat_n(1, 100).collect();
    let mut d = IncrementalDecoder::new(&long);
    assert_eq!(d.ids.len(), PROMPT_CONTEXT);
    assert_eq!(d.push(&tok, 2).unwrap(), " world");
}

#[test]
fn a_character_split_by_the_prompt_comes_out_whole() {
    let tok = fixture();
    let euro = tok.encode("€", false).unwrap();
    assert!(euro.len() >= 2, "€ is {euro:?}");
    let (head, last) = euro.split_at(euro.len() - 1);
    assert!(tok.decode(head).unwrap().ends_with('\u{FFFD}'));
    let (deltas, _) = stream(&tok, head, last);
    assert_eq!(deltas, ["€"]);
    // Without the prompt it is the lone byte's decode.
    let (deltas, tail) = stream(&tok, &[], last);
    assert_eq!(deltas.concat() + &tail, tok.decode(last).unwrap());
}

/// Ids for the property test: random ids of the fixture's vocabulary (lone bytes of multi-byte
/// characters, special tokens, ...), or the encoding of text with multi-byte characters.
fn ids(tok: &Tokenizer) -> impl Strategy<Value = Vec<u32>> + '_ {
    let vocab = tok.vocab_size() as u32;
    prop_oneof![
        prop::collection::vec(0..vocab, 0..24),
        "[a-z é€😀中,\n]{0,16}".prop_map(move |s| tok.encode(&s, false).unwrap()),
    ]
}

#[test]
fn deltas_add_up_to_the_decode_at_every_step() {
    let tok = fixture();
    let held = Cell::new(0usize);
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (ids(&tok), ids(&tok));
    runner
        .run(&strategy, |(prompt, gen_ids)| {
            let mut d = IncrementalDecoder::new(&[]);
            for (i, &id) in gen_ids.iter().enumerate() {
                let before = d.text().len();
                let delta = d.push(&tok, id).unwrap();
                prop_assert_eq!(&d.text()[before..], &delta[..]);
                let full = tok.decode(&gen_ids[..=i]).unwrap();
                prop_assert!(full.starts_with(d.text()), "{:?} / {:?}", d.text(), full);
                if full.ends_with('\u{FFFD}') {
                    if d.text() != full {
                        held.set(held.get() + 1);
                    }
                } else {
                    prop_assert_eq!(d.text(), &full[..]);
                }
            }
            d.flush(&tok).unwrap();
            prop_assert_eq!(d.text(), tok.decode(&gen_ids).unwrap());

            // With a prompt whose text ends in a whole character, this byte-level tokenizer
            // (no leading-space handling) gives the same text.
            let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
            if !tok.decode(tail).unwrap().ends_with('\u{FFFD}') {
                let (deltas, rest) = stream(&tok, &prompt, &gen_ids);
                prop_assert_eq!(deltas.concat() + &rest, tok.decode(&gen_ids).unwrap());
            }
            Ok(())
        })
        .unwrap();
    // Incomplete characters were held back in many cases.
    assert!(held.get() > 50, "held back {} times", held.get());
}

#[test]
fn stop_strings_are_found_across_deltas() {
    let mut m = StopMatcher::new(vec!["STOP".into(), "\n\n".into()]).unwrap();
    assert_eq!(m.push("Hello S"), ("Hello ".into(), None));
    assert_eq!(m.push("T"), ("".into(), None));
    // Not a stop after all: the held "ST" goes out.
    assert_eq!(m.push("ay. S"), ("STay. ".into(), None));
    assert_eq!(m.push("TOP and more"), ("".into(), Some("STOP".into())));
    assert_eq!(m.stopped(), Some("STOP"));
    assert_eq!(m.push("x"), ("".into(), None));
    assert_eq!(m.flush(), "");

    let mut m = StopMatcher::new(vec!["\n\n".into()]).unwrap();
    assert_eq!(m.push("a\n"), ("a".into(), None));
    assert_eq!(m.flush(), "\n");
    assert_eq!(m.stopped(), None);
}

#[test]
fn overlapping_and_multibyte_stops() {
    // "bc" is complete before "abcd" can be: the text stops at the first complete stop.
    let mut m = StopMatcher::new(vec!["abcd".into(), "bc".into()]).unwrap();
    assert_eq!(m.push("xab"), ("x".into(), None));
    assert_eq!(m.push("cd"), ("a".into(), Some("bc".into())));
    // Two stops ending at the same character: the longer one.
    let mut m = StopMatcher::new(vec!["b".into(), "ab".into()]).unwrap();
    assert_eq!(m.push("xab"), ("x".into(), Some("ab".into())));
    // A stop inside a longer one's prefix: "aab" has "ab" ending at b.
    let mut m = StopMatcher::new(vec!["aac".into(), "ab".into()]).unwrap();
    assert_eq!(m.push("a"), ("".into(), None));
    assert_eq!(m.push("a"), ("".into(), None));
    assert_eq!(m.push("b"), ("a".into(), Some("ab".into())));
    // Multi-byte characters: the held tail is whole characters.
    let mut m = StopMatcher::new(vec!["€€x".into()]).unwrap();
    assert_eq!(m.push("é€"), ("é".into(), None));
    assert_eq!(m.push("€"), ("".into(), None));
    assert_eq!(m.push("€"), ("€".into(), None));
    assert_eq!(m.push("x!"), ("".into(), Some("€€x".into())));
    let mut m = StopMatcher::new(vec!["😀".into()]).unwrap();
    assert_eq!(m.push("中😀"), ("中".into(), Some("😀".into())));
    // No stops: everything at once.
    let mut m = StopMatcher::new(Vec::new()).unwrap();
    assert_eq!(m.push("abc"), ("abc".into(), None));
    let err = StopMatcher::new(vec!["a".into(), String::new()])
        .err()
        .unwrap();
    assert!(err.to_string().contains("stop string 1 is empty"), "{err}");
}

/// The expected released text and stop: the stop that is complete first (the longest of those
/// complete at the same place), by `str::find`.
fn reference(text: &str, stops: &[String]) -> (String, Option<String>) {
    let first = stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), s)))
        .min_by_key(|&(end, s)| (end, std::cmp::Reverse(s.len())));
    match first {
        Some((end, s)) => (text[..end - s.len()].to_string(), Some(s.clone())),
        None => (text.to_string(), None),
    }
}

#[test]
fn released_text_is_the_text_cut_at_the_first_stop() {
    let (stops_hit, released_late) = (Cell::new(0usize), Cell::new(0usize));
    let mut runner = TestRunner::new(Config {
        cases: 1024,
        failure_persistence: None,
        ..Config::default()
    });
    // A small alphabet with multi-byte characters, so stops overlap and recur often.
    let strategy = (
        prop::collection::vec("[ab€😀]{1,4}", 0..4),
        prop::collection::vec("[ab€😀]{0,5}", 0..12),
    );
    runner
        .run(&strategy, |(stops, deltas)| {
            let mut m = StopMatcher::new(stops.clone()).unwrap();
            let longest = stops.iter().map(|s| s.chars().count()).max().unwrap_or(0);
            let text: String = deltas.concat();
            let (want, want_stop) = reference(&text, &stops);
            let (mut fed, mut out, mut stop) = (String::new(), String::new(), None);
            for d in &deltas {
                fed.push_str(d);
                let (released, s) = m.push(d);
                out.push_str(&released);
                prop_assert!(
                    want.starts_with(&out),
                    "{:?} is not a start of {:?}",
                    out,
                    want
                );
                if s.is_some() {
                    stop = s;
                    break;
                }
                // Held back: at most the longest stop less one character.
                let held = fed[out.len()..].chars().count();
                prop_assert!(
                    held < longest.max(1),
                    "{} held, longest stop {}",
                    held,
                    longest
                );
                if !released.is_empty() && released.len() > d.len() {
                    released_late.set(released_late.get() + 1);
                }
            }
            out.push_str(&m.flush());
            prop_assert_eq!(&out, &want);
            prop_assert_eq!(&stop, &want_stop);
            prop_assert_eq!(m.stopped(), want_stop.as_deref());
            if stop.is_some() {
                stops_hit.set(stops_hit.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    assert!(stops_hit.get() > 200, "{} stops", stops_hit.get());
    assert!(
        released_late.get() > 50,
        "{} late releases",
        released_late.get()
    );
}
