//! A JSON value that borrows its strings from the bytes it was parsed from, for readers
//! that look at a body once and keep nothing of it (the token estimate). serde_json's
//! `Value` copies every key and string and keeps each object in a B-tree: for a short chat
//! request that is a dozen allocations the estimate only reads and frees.
//!
//! It reads as `Value` does: an object keeps its members in order, duplicates included,
//! [`Json::get`] finds the last of a name (the one `Value` keeps), and serializing writes
//! what `Value` would (members sorted by name, one per name, numbers as `Value` prints
//! them), so text counted as JSON is the same text.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use std::borrow::Cow;
use std::fmt;

/// One JSON value; strings without escapes borrow from the input.
#[derive(Debug, PartialEq)]
pub enum Json<'a> {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    /// Members in the input's order, a repeated name as often as it came.
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

impl<'a> Json<'a> {
    /// Parses one JSON value, with nothing but whitespace after it (as
    /// `serde_json::from_slice` does).
    pub fn parse(bytes: &'a [u8]) -> serde_json::Result<Json<'a>> {
        serde_json::from_slice(bytes)
    }

    /// The member `name` of an object (its last, if repeated); `None` for anything else.
    pub fn get(&self, name: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(members) => members.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Json<'a>]> {
        match self {
            Json::Array(items) => Some(items),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }
}

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json<'de>, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Json<'de>, E> {
        // As `Value`: a float JSON cannot hold is null.
        Ok(serde_json::Number::from_f64(v).map_or(Json::Null, Json::Number))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(v)))
    }

    fn visit_none<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
        while let Some(Key(k)) = map.next_key()? {
            members.push((k, map.next_value()?));
        }
        Ok(Json::Object(members))
    }
}

/// A member's name, borrowed where it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key<'de>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Number(n) => n.serialize(s),
            Json::String(v) => s.serialize_str(v),
            Json::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(members) => {
                // As `Value` holds them: by name, the last of a repeated name. A stable
                // sort keeps a name's members in input order, so the last is its last.
                let mut sorted: Vec<&(Cow<'_, str>, Json<'_>)> = members.iter().collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                let kept: Vec<_> = sorted
                    .iter()
                    .enumerate()
                    .filter(|(i, m)| sorted.get(i + 1).is_none_or(|next| next.0 != m.0))
                    .map(|(_, m)| *m)
                    .collect();
                let mut map = s.serialize_map(Some(kept.len()))?;
                for (k, v) in kept {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    fn same_as_value(text: &str) {
        let value: serde_json::Result<Value> = serde_json::from_str(text);
        let json = Json::parse(text.as_bytes());
        match (value, json) {
            (Ok(v), Ok(j)) => assert_eq!(serde_json::to_string(&j).unwrap(), v.to_string(), "{text}"),
            (Err(_), Err(_)) => {}
            (v, j) => panic!("{text}: Value {v:?}, Json {j:?}"),
        }
    }

    #[test]
    fn it_reads_and_writes_what_value_does() {
        for text in [
            r#"{"b":1,"a":[true,false,null],"c":{"z":"x","y":"\u00e9\n\"q\""}}"#,
            r#"{"a":1,"a":2,"b":{"k":"first","k":"last"}}"#,
            r#"[1.0, 1e3, -0, -0.0, 18446744073709551615, 18446744073709551616, -9223372036854775808, 0.1, 1.5e-10]"#,
            r#"{"\u0061":"escaped name","a":"plain"}"#,
            r#"{"emoji":"\ud83d\ude00","raw":"😀","ctl":"\u0001\t"}"#,
            "  {\"sp\" : [ ] , \"o\" : { } }  ",
            r#""just a string""#,
            "12",
            "{} x",
            "{\"a\":",
            "[1,]",
            "{\"a\":1,}",
            "\"\\ud800\"",
        ] {
            same_as_value(text);
        }
    }

    #[test]
    fn get_finds_the_last_member_of_a_name_and_strings_borrow() {
        let body = br#"{"role":"system","role":"user","content":"hi","esc":"a\nb"}"#;
        let j = Json::parse(body).unwrap();
        assert_eq!(j.get("role").and_then(Json::as_str), Some("user"));
        assert!(matches!(j.get("content"), Some(Json::String(Cow::Borrowed("hi")))));
        assert!(matches!(j.get("esc"), Some(Json::String(Cow::Owned(_)))));
        assert_eq!(j.get("missing"), None);
        assert_eq!(Json::parse(b"[1]").unwrap().get("a"), None);
    }

    #[test]
    fn a_body_nested_past_the_parsers_limit_is_refused_as_value_refuses_it() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        same_as_value(&deep);
        assert!(Json::parse(deep.as_bytes()).is_err());
    }

    fn arb_json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            any::<bool>().prop_map(|b| b.to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| format!("{f:e}")),
            "[a-c\\\\\"é😀\n ]{0,6}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        ];
        leaf.prop_recursive(4, 40, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec(("[a-c]{0,2}", inner), 0..5).prop_map(|m| {
                    let members: Vec<String> = m
                        .into_iter()
                        .map(|(k, v)| format!("{}:{v}", serde_json::to_string(&k).unwrap()))
                        .collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn any_document_reads_and_writes_as_value(text in arb_json()) {
            same_as_value(&text);
        }
    }
}
